"""The expert activations the kernels implement: act(gate, up) on the two halves of w13 @ x."""

ACTIVATIONS = ("silu", "gelu_tanh", "swigluoai")

# gpt-oss's clamped SwiGLU ("swigluoai"): gate clamped above at LIMIT, up to [-LIMIT, LIMIT],
# (up + 1) * gate * sigmoid(ALPHA * gate).
SWIGLUOAI_ALPHA = 1.702
SWIGLUOAI_LIMIT = 7.0
