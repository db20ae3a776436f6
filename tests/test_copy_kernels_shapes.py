"""`benchmarks/copy_kernels.py --shape medium` copies the tensors of RESULTS.md's `$MEDIUM`
checkpoint (the GPU part needs CUDA; the shape does not)."""

from __future__ import annotations

import math

from repo_scripts import load_script
from rollout_engines.testing.shapes import tensor_shapes

copy_kernels = load_script("benchmarks/copy_kernels.py")


def test_the_medium_shape_is_the_medium_checkpoints_tensors():
    shapes = tensor_shapes(copy_kernels.medium_shape(), qwen3=False)
    # $MEDIUM in RESULTS.md (and `bench push`'s JSON for it): 195 tensors, 1,954,779,136 bf16 bytes
    assert len(shapes) == 195
    assert sum(2 * math.prod(s) for _, s in shapes) == 1_954_779_136
    sizes = sorted({2 * math.prod(s) for _, s in shapes}, reverse=True)
    assert sizes[0] == 32 * 2**20  # the MLP matrices, copied by memcpy (at least 16 MiB)
