"""The sparse MoE block's kernels: the router's softmax and top-k (moe_route), the experts'
SwiGLU and the weighted combine (fused_moe)."""
