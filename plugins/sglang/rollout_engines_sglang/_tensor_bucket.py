"""SGLang's flattened tensor bucket, vendored for environments without SGLang.

Copied from SGLang 0.5.17, ``python/sglang/srt/weight_sync/tensor_bucket.py``
(https://github.com/sgl-project/sglang, Apache License 2.0), trimmed to what the payload code and
its tests use. :func:`rollout_engines_sglang.payloads.tensor_bucket_classes` returns SGLang's own
classes whenever SGLang is importable: SGLang's receiver only unpickles classes of its own modules,
so a payload sent to a real engine must carry SGLang's metadata class, never this copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class FlattenedTensorMetadata:
    """Metadata for a tensor in a flattened bucket (byte offsets into a uint8 buffer)."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


class FlattenedTensorBucket:
    """Several tensors in one flat uint8 tensor, plus the metadata to take them apart again."""

    supports_multi_dtypes = True

    def __init__(
        self,
        named_tensors: list[tuple[str, torch.Tensor]] | None = None,
        flattened_tensor: torch.Tensor | None = None,
        metadata: list[FlattenedTensorMetadata] | None = None,
    ) -> None:
        if named_tensors is not None:
            if not named_tensors:
                raise ValueError("Cannot create empty tensor bucket")
            self.metadata: list[FlattenedTensorMetadata] = []
            parts: list[torch.Tensor] = []
            current = 0
            for name, tensor in named_tensors:
                flat = tensor.flatten().view(torch.uint8)
                parts.append(flat)
                numel = flat.numel()
                self.metadata.append(
                    FlattenedTensorMetadata(name, tensor.shape, tensor.dtype, current, current + numel, numel)
                )
                current += numel
            self.flattened_tensor = torch.cat(parts, dim=0)
        else:
            if flattened_tensor is None or metadata is None:
                raise ValueError("Must provide either named_tensors or both flattened_tensor and metadata")
            self.flattened_tensor = flattened_tensor
            self.metadata = metadata

    def get_flattened_tensor(self) -> torch.Tensor:
        return self.flattened_tensor

    def get_metadata(self) -> list[FlattenedTensorMetadata]:
        return self.metadata

    def reconstruct_tensors(self) -> list[tuple[str, torch.Tensor]]:
        return [
            (m.name, self.flattened_tensor[m.start_idx : m.end_idx].view(m.dtype).reshape(m.shape))
            for m in self.metadata
        ]
