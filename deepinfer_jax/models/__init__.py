"""Model definitions of the DeepSeek family (V3, V4, V4.1) and the built-in tiny test models (`builtin`)."""
