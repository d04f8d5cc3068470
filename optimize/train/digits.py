"""Train the digits CNN on the calibration (training) split of scikit-learn's digits.

    python -m optimize.train.digits optimize/assets/digits_cnn [--epochs 30] [--seed 0]

Writes config.json and model.safetensors (no pickle). Seconds on one CPU core. The held-out
(evaluation) split is never trained on: it is what the quantized model's accuracy is gated on.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

CONFIG = {
    "architecture": "digits_cnn",
    "channels": [16, 32],
    "hidden": 64,
    "num_classes": 10,
    "image_size": 8,
    "pixel_max": 16.0,
}


def train(out_dir: Path, epochs: int = 30, seed: int = 0, batch_size: int = 64, lr: float = 3e-3) -> dict:
    import torch
    from safetensors.torch import save_file

    from calibration.images import digits
    from optimize.tasks.image_classification import build_cnn, encode_images, top1_accuracy

    torch.manual_seed(seed)
    train_set, test_set = digits("calibration"), digits("evaluation")
    x = torch.from_numpy(encode_images(train_set.items)["pixel_values"])
    y = torch.tensor(train_set.labels)
    model = build_cnn(dict(CONFIG, seed=seed))
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        model.train()
        for idx in torch.randperm(len(x), generator=generator).split(batch_size):
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
            optimizer.step()
    model.eval()
    with torch.inference_mode():
        logits = model(torch.from_numpy(encode_images(test_set.items)["pixel_values"])).numpy()
    accuracy = top1_accuracy(logits, np.asarray(test_set.labels))
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(out_dir / "model.safetensors"))
    trained = {
        "data": "sklearn digits, calibration split",
        "items": len(x),
        "epochs": epochs,
        "seed": seed,
        "heldout_top1_accuracy": round(accuracy, 4),
    }
    (out_dir / "config.json").write_text(json.dumps(dict(CONFIG, seed=seed, trained=trained), indent=2) + "\n")
    return trained


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(json.dumps(train(args.out_dir, args.epochs, args.seed)))


if __name__ == "__main__":
    main()
