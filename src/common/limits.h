// Limits of the kernels that the Python runtime plans around. One definition, read by the kernels
// and exposed to Python by ft_ops._C.limits(), so no number is written down twice.
#pragma once

#include <cstdint>

namespace ft::limits {

// torch._grouped_mm takes fewer than 1,024 groups: expert_gemm's grouped path uses one group per
// slot of the bank it is given, so a larger bank is computed one window of this many slots at a
// time (1.2-1.4x the time of one window).
constexpr int64_t kGroupedGemmMaxSlots = 1023;

// expert_gemm takes the grouped (tensor-core GEMM) path from this many tokens on (bf16, sm_90);
// fewer tokens take the decode kernels, which read each routed expert's rows once.
constexpr int64_t kGroupedGemmMinTokens = 64;

// A prompt-sized expert_gemm call on a quantized layer (through a slot_map) dequantizes the layer's
// experts into a scratch bank of at most this many bytes, a window of experts at a time: the scratch
// stays small beside the cache where a layer expands to several GB (GPT-OSS-120B's 6.4 GB in bf16,
// DeepSeek-V3's 22.5 GB), while a layer of Qwen3-30B-A3B's shape (1.1 GiB) is one window.
constexpr int64_t kDequantizeWindowBytes = int64_t{2} << 30;

// Grids of the copy kernels (blocks; each takes one SM): copy_experts' kernel, and
// async_layer_copy's with skip_resident and no row_sources. 8 blocks of 512 threads already read pinned memory at the
// link's rate and leave the other SMs to the GEMMs beside them.
constexpr int kCopyBlocks = 8;
constexpr int kLayerCopyBlocks = 16;

// dedup_and_admit: routed ids of a decode call (one per lane of the routing warp), the largest pool
// of its one-block kernels (larger pools scan the stamps in global memory), and the pool's bound.
constexpr int64_t kDecodeCallMaxIds = 32;
constexpr int64_t kMaxRegisterPoolSlots = 8192;
constexpr int kSlotBits = 24;
constexpr int64_t kMaxSlots = (int64_t{1} << kSlotBits) - 1;

}  // namespace ft::limits
