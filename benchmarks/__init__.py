"""One-off studies beside the scripts that drive them (the GPU kit, the cost comparisons); ``llmpipe bench`` lives in llmpipe/bench."""
