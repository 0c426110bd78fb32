"""Hugging Face Trainer: `Trainer(..., callbacks=[TorchtopCallback()])`.

The automatic hooks already see the Trainer's loop; the callback starts the agent when training
begins and forwards the scalars the Trainer logs (loss, learning_rate, grad_norm) as marks.
"""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback  # pyright: ignore[reportMissingImports]  # optional

import torchtop.agent as agent


class TorchtopCallback(TrainerCallback):
    def __init__(self, **start_kwargs: Any) -> None:
        self.start_kwargs = start_kwargs

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        agent.start(**self.start_kwargs)

    def on_log(
        self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any
    ) -> None:
        for key, value in (logs or {}).items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                agent.mark(key, value)
