#!/usr/bin/env python3
"""torch_loader_ref.py - the Fashion-MNIST input pipeline of pipeline_bench.sh
as PyTorch users write it: a map-style Dataset over the decoded uint8 images
(as torchvision's FashionMNIST holds them; torchvision is not installed here)
with a per-sample transform (normalize, random horizontal flip), and a
DataLoader with batch 128, shuffle, and num_workers workers (prefetch_factor 2,
the default). Torch gets the data already decoded from IDX: no TFRecord read
or Example parse, which favours it. Prints one JSON line: samples/s over
`--samples` samples (whole batches; the workers' start-up is inside the time).
    /usr/bin/python3 torch_loader_ref.py --images IDX.gz --labels IDX.gz [--workers 2] [--samples 60000]"""
import argparse
import gzip
import json
import resource
import time

import numpy as np
import torch

MEAN, STD = 72.94, 90.02


def load_idx(path):
    with gzip.open(path, "rb") as f:
        raw = f.read()
    ndim = raw[3]
    dims = [int.from_bytes(raw[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim)]
    return np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)


class FashionMNIST(torch.utils.data.Dataset):
    def __init__(self, images, labels):
        self.images = torch.from_numpy(images.copy())
        self.labels = torch.from_numpy(labels.astype(np.int64))

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        img = (self.images[i].unsqueeze(0).float() - MEAN) / STD  # ToTensor-like (1, 28, 28), then Normalize
        if torch.rand(1).item() < 0.5:  # RandomHorizontalFlip
            img = img.flip(-1)
        return img, self.labels[i]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--images", required=True)
    ap.add_argument("--labels", required=True)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--samples", type=int, default=60000)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=42)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    ds = FashionMNIST(load_idx(a.images), load_idx(a.labels))
    loader = torch.utils.data.DataLoader(ds, batch_size=128, shuffle=True, num_workers=a.workers,
                                         persistent_workers=False)
    samples, checksum = 0, 0.0
    t0 = time.perf_counter()
    while samples < a.samples:
        for img, label in loader:
            samples += label.shape[0]
            if samples >= a.samples:
                break
    checksum = float(img.sum())
    dt = time.perf_counter() - t0
    print(json.dumps({"impl": "torch", "torch": torch.__version__, "workers": a.workers, "samples": samples,
                      "seconds": round(dt, 3), "samples_per_sec": round(samples / dt, 1),
                      "maxrss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
                      "checksum": round(checksum, 2)}))


if __name__ == "__main__":
    main()
