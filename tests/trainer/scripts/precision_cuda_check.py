"""trainer.precision on CUDA, without the engine: loads bpstrain/trainer/_precision.py by
path (it needs only torch), so it runs on a GPU machine whose Python cannot load this
checkout's compiled extension. Usage: python tests/trainer/scripts/precision_cuda_check.py
Prints one line per check and exits non-zero on the first failure."""

import contextlib
import importlib.util
import math
import sys
import types
from pathlib import Path

import torch

path = Path(__file__).resolve().parents[3] / "bpstrain" / "trainer" / "_precision.py"
spec = importlib.util.spec_from_file_location("_precision", path)
precision_mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(precision_mod)


def fake_trainer(optimizer, clip=None):
    cfg = types.SimpleNamespace(trainer=types.SimpleNamespace(
        gradient_clip_val=clip, gradient_clip_algorithm="norm"))
    return types.SimpleNamespace(optimizer=optimizer, config=cfg, callbacks=[],
                                 last_grad_norm=None)


def run(name: str):
    device = torch.device("cuda")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 4)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    prec = precision_mod.Precision(name, device)
    trainer = fake_trainer(opt, clip=1.0)
    hooks = []
    fire = lambda cbs, event, *a, **k: hooks.append(event)  # noqa: E731
    x = torch.randn(512, 64, device=device)
    y = (x[:, :4].argmax(1)).to(device)
    losses, dtypes, skipped = [], set(), 0
    for step in range(60):
        with prec.autocast():
            out = model(x)
            dtypes.add(out.dtype)
            loss = torch.nn.functional.cross_entropy(out, y)
        prec.backward(loss.float())
        if step == 5 and prec.scaler is not None:  # an overflow: the step must be skipped
            next(model.parameters()).grad.view(-1)[0] = math.inf
            before = [p.detach().clone() for p in model.parameters()]
            scale = prec.scaler.get_scale()
        precision_mod.optimizer_step(trainer, model, prec, fire)
        if step == 5 and prec.scaler is not None:
            assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
            assert prec.scaler.get_scale() == scale / 2
            skipped += 1
        opt.zero_grad()
        losses.append(loss.item())
    expected = {"32": torch.float32, "bf16": torch.bfloat16, "16": torch.float16}[name]
    assert dtypes == {expected}, dtypes
    assert losses[-1] < 0.6 * losses[0], (losses[0], losses[-1])
    assert hooks.count("before_optimizer_step") == 60
    assert trainer.last_grad_norm is not None
    scaler = prec.scaler
    print(f"precision={name}: logits {expected}, loss {losses[0]:.3f} -> {losses[-1]:.3f}, "
          f"scaler={'cuda' if scaler is not None else None}"
          f"{f' scale={scaler.get_scale():g} skipped={skipped}' if scaler else ''}; OK",
          flush=True)


if __name__ == "__main__":
    print(f"torch {torch.__version__} on {torch.cuda.get_device_name(0)}")
    for name in ("32", "bf16", "16"):
        run(name)
