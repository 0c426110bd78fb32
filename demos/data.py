"""The demos' synthetic data and its DataLoader: images made on the fly, with a knob that makes
the loader as slow as a scenario needs, and workers that stop cleanly on SIGTERM."""

from __future__ import annotations

import os
import signal
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset


class SyntheticImages(Dataset):
    """Images made on the fly: a class template, shifted, under Gaussian noise; the label is the class.

    Each item is generated from its index alone (so workers need no shared state and every epoch
    sees the same data). `augment_passes` repeats a blur-and-mix pass per item: 0 is cheap
    (about 0.1 ms an item), larger values make the loader the bottleneck.
    """

    def __init__(
        self,
        length: int = 100_000,
        num_classes: int = 10,
        size: int = 32,
        channels: int = 3,
        signal: float = 0.3,
        max_shift: int = 3,
        augment_passes: int = 0,
        seed: int = 0,
    ) -> None:
        self.length = length
        self.num_classes = num_classes
        self.size = size
        self.channels = channels
        self.signal = signal
        self.max_shift = max_shift
        self.augment_passes = augment_passes
        self.seed = seed
        g = torch.Generator().manual_seed(seed)
        # Smooth templates (upsampled coarse noise) so shifted copies still look alike.
        coarse = torch.randn(num_classes, channels, size // 4, size // 4, generator=g)
        self.templates = nn.functional.interpolate(
            coarse, size=(size, size), mode="bilinear", align_corners=False
        )

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        label = int(torch.randint(self.num_classes, (1,), generator=g))
        image = self.templates[label] * self.signal + torch.randn(
            self.channels, self.size, self.size, generator=g
        )
        if self.max_shift:
            dy, dx = torch.randint(-self.max_shift, self.max_shift + 1, (2,), generator=g).tolist()
            image = torch.roll(image, shifts=(dy, dx), dims=(1, 2))
        for _ in range(self.augment_passes):
            blurred = nn.functional.avg_pool2d(image.unsqueeze(0), 3, stride=1, padding=1).squeeze(0)
            image = 0.5 * image + 0.5 * blurred
        return image, label


WORKER_TERM_GRACE_S = 5.0


def _worker_on_sigterm(signum: int, frame: Any) -> None:
    signal.setitimer(signal.ITIMER_REAL, WORKER_TERM_GRACE_S)  # then `_worker_on_alarm`


def _worker_on_alarm(signum: int, frame: Any) -> None:
    os._exit(0)  # a clean exit status: torch reports workers killed by a signal as errors


def _worker_init(worker_id: int) -> None:
    """A SIGTERM sent to the whole process group (`timeout`, `kill -- -PGID`, a job scheduler)
    reaches the loader workers too. Dying at once would break the step in flight ("DataLoader
    worker is killed by signal") while the training process, which got the same signal, is
    finishing it; ignoring it would hang whoever terminates and joins them (multiprocessing does
    at exit). So a worker gives the training process WORKER_TERM_GRACE_S to stop and shut it
    down, then exits anyway.
    """
    signal.signal(signal.SIGALRM, _worker_on_alarm)
    signal.signal(signal.SIGTERM, _worker_on_sigterm)


def make_loader(
    dataset: Dataset,
    batch_size: int,
    workers: int,
    device: torch.device,
    pin_memory: bool | None = None,
    prefetch_factor: int | None = None,
) -> DataLoader:
    """A shuffling DataLoader; persistent workers, pinned memory when the batches go to a GPU."""
    kwargs: dict[str, Any] = {}
    if workers > 0:
        kwargs.update(persistent_workers=True, worker_init_fn=_worker_init)
        if prefetch_factor is not None:
            kwargs["prefetch_factor"] = prefetch_factor
    return DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=True,
        num_workers=workers,
        pin_memory=(device.type == "cuda") if pin_memory is None else pin_memory,
        drop_last=True,
        **kwargs,
    )
