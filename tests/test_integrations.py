"""The framework integrations on real CPU loops; each skips cleanly where its package is missing."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import torchtop.agent as ta
from tests.agent_util import snapshot_steps

pytestmark = [pytest.mark.slow, pytest.mark.integrations]  # real Lightning / Hugging Face loops


def _data(n: int = 32) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 16, generator=g), torch.randint(0, 3, (n,), generator=g))


def test_lightning_callback_steps_and_loss(tmp_path) -> None:
    pl = pytest.importorskip("lightning.pytorch")
    from torchtop.agent.integrations.lightning import TorchtopCallback

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 3))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer = pl.Trainer(
        max_steps=8,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        callbacks=[TorchtopCallback()],
    )
    trainer.fit(Tiny(), DataLoader(_data(), batch_size=4))
    steps = snapshot_steps(ta.current(), 8)
    assert len(steps) == 8
    assert all(
        s.phases["forward"] > 0 and s.phases["backward"] > 0 and s.phases["optimizer"] > 0 for s in steps
    )
    assert all("loss" in s.marks for s in steps)


def test_huggingface_trainer_callback(tmp_path) -> None:
    transformers = pytest.importorskip("transformers")
    from torchtop.agent.integrations.huggingface import TorchtopCallback

    class Tiny(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Linear(16, 3)

        def forward(self, x, labels=None):
            assert labels is not None  # the Trainer passes each row's
            logits = self.net(x)
            return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}

    ds = _data()
    rows = [{"x": ds[i][0], "labels": ds[i][1]} for i in range(len(ds))]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=6,
        per_device_train_batch_size=4,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    trainer = transformers.Trainer(
        model=Tiny(), args=args, train_dataset=rows, callbacks=[TorchtopCallback()]
    )
    trainer.train()
    steps = snapshot_steps(ta.current(), 6)
    assert len(steps) == 6
    assert all(s.phases["backward"] > 0 and s.phases["optimizer"] > 0 for s in steps)
    assert sum("loss" in s.marks for s in steps) >= 5  # logged every step, after its optimizer step


def test_accelerate_gradient_accumulation_through_auto_hooks() -> None:
    accelerate = pytest.importorskip("accelerate")
    assert ta.start() is not None
    acc = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=2)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt, dl = acc.prepare(model, opt, DataLoader(_data(), batch_size=4))
    for x, y in dl:
        with acc.accumulate(model):
            loss = nn.functional.cross_entropy(model(x), y)
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
    steps = snapshot_steps(ta.current(), 4)
    assert len(steps) == 4  # 8 batches, an optimizer step every 2
    assert [s.micro for s in steps] == [2, 2, 2, 2]
