"""Vision example: a small torchvision-style residual net (convolutions + BatchNorm) on images.

The images are scikit-learn's bundled 8x8 digits as [N, 1, 8, 8] float tensors (nothing downloaded), and
the model is written the way torchvision's ResNet is (conv-BN-ReLU stem, basic residual blocks, global
average pooling, linear head), with no compiled torchvision ops. ``model(x)`` takes a tensor.

``load_dataset`` gives the same task with the training images as a map-style ``torch.utils.data.Dataset``
read item by item: each digit also appears shifted by one pixel in each direction (5 views, computed on
access, never materialised), as a larger-than-memory training set would be.
"""

from __future__ import annotations

import torch

from pipeline.examples.digits import digits_table

SHIFTS = ((0, 0), (1, 0), (-1, 0), (0, 1), (0, -1))


def _digits(eval_fraction: float, split_seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    pixels, labels = digits_table()
    x = torch.tensor(pixels.reshape(-1, 8, 8), dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(labels, dtype=torch.long)
    perm = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(split_seed))
    n_eval = int(round(eval_fraction * x.shape[0]))
    return perm[n_eval:], perm[:n_eval], x, y


def load_data(eval_fraction: float = 0.25, split_seed: int = 0, **_: object) -> dict:
    """Images [N, 1, 8, 8] in [0, 1], a fixed split, ids naming the dataset row."""
    train_idx, eval_idx, x, y = _digits(eval_fraction, split_seed)
    return {
        "train_x": x[train_idx],
        "train_y": y[train_idx],
        "eval_x": x[eval_idx],
        "eval_y": y[eval_idx],
        "eval_ids": [f"digits-{int(i):04d}" for i in eval_idx],
    }


class ShiftedDigits(torch.utils.data.Dataset):
    """Item ``i``: image ``i % n`` shifted by ``SHIFTS[i // n]`` (zeros enter at the border), and its label."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor) -> None:
        self.images, self.labels = images, labels

    def __len__(self) -> int:
        return self.images.shape[0] * len(SHIFTS)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = self.images.shape[0]
        dy, dx = SHIFTS[i // n]
        image = torch.roll(self.images[i % n], shifts=(dy, dx), dims=(1, 2))
        if dy:
            image[:, 0 if dy > 0 else -1, :] = 0
        if dx:
            image[:, :, 0 if dx > 0 else -1] = 0
        return image, self.labels[i % n]


def load_dataset(eval_fraction: float = 0.25, split_seed: int = 0, **_: object) -> dict:
    """As ``load_data``, with the training set a ``ShiftedDigits`` Dataset (5 views of each image)."""
    train_idx, eval_idx, x, y = _digits(eval_fraction, split_seed)
    return {
        "train_x": ShiftedDigits(x[train_idx], y[train_idx]),
        "eval_x": x[eval_idx],
        "eval_y": y[eval_idx],
        "eval_ids": [f"digits-{int(i):04d}" for i in eval_idx],
    }


class BasicBlock(torch.nn.Module):
    """torchvision's BasicBlock: two 3x3 conv-BN, a residual (1x1 conv-BN when the shape changes), ReLU."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(cout)
        self.conv2 = torch.nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = torch.nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = torch.nn.Sequential(torch.nn.Conv2d(cin, cout, 1, stride, bias=False), torch.nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + (x if self.downsample is None else self.downsample(x)))


class SmallResNet(torch.nn.Module):
    def __init__(self, channels: int = 1, width: int = 16, classes: int = 10) -> None:
        super().__init__()
        self.stem = torch.nn.Sequential(
            torch.nn.Conv2d(channels, width, 3, 1, 1, bias=False), torch.nn.BatchNorm2d(width), torch.nn.ReLU()
        )
        self.layer1 = BasicBlock(width, width, 1)
        self.layer2 = BasicBlock(width, 2 * width, 2)
        self.fc = torch.nn.Linear(2 * width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.layer2(self.layer1(self.stem(x)))
        return self.fc(h.mean(dim=(2, 3)))


def build_model(width: int = 16, classes: int = 10, **_: object) -> torch.nn.Module:
    return SmallResNet(1, width, classes)
