"""PyTorch Lightning: `Trainer(callbacks=[TorchtopCallback()])`.

The automatic hooks already see Lightning's loop (its optimizer step calls optimizer.step()); the
callback starts the agent with the Trainer and attaches the logged training loss to each step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # one base for the checker; at run time whichever package is installed
    from lightning.pytorch.callbacks import Callback  # pyright: ignore[reportMissingImports]  # optional
else:
    try:
        from lightning.pytorch.callbacks import Callback
    except ImportError:  # the older package name
        from pytorch_lightning.callbacks import Callback

import torchtop.agent as agent


class TorchtopCallback(Callback):
    def __init__(self, **start_kwargs: Any) -> None:
        super().__init__()
        self.start_kwargs = start_kwargs

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        agent.start(**self.start_kwargs)

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if loss is not None and hasattr(loss, "numel"):
            agent.mark("loss", loss)
