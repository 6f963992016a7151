// How many SMs the copy kernels of layer_copy.cu take (their grid; one block per SM at most), so
// that GEMMs running beside them can leave those SMs free (ft_ops/sm_share.py).
#pragma once

namespace ft::cuda {

// Blocks of copy_experts' kernel (layer_copy = false) or of async_layer_copy's skip_resident
// kernel (layer_copy = true), FT_COPY_BLOCKS / FT_LAYER_COPY_BLOCKS included.
int copy_kernel_blocks(bool layer_copy);

}  // namespace ft::cuda
