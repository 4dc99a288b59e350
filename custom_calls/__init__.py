"""Native kernels and lowerings outside the engine package: CuteDSL (SM100), C++ XLA FFI targets, Ascend."""
