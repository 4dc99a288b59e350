"""DeepSeek-V4 and V4.1: mHC, compressed sparse attention, Engram, DSpark; `synthetic` writes random checkpoints."""
