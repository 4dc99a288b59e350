"""DeepSeek-V3: MLA attention, DeepSeekMoE and multi-token prediction; `synthetic` writes random checkpoints."""
