"""A user's own model, swapped in by the template tests: a tiny causal transformer language model (~27k parameters)
with dict batches, a token-weighted loss, its own optimizer groups and its own learning-rate schedule, dropout (so
a resume must restore every random stream exactly, the stream's loader included), and its output layer tied to the
token embedding (so fsdp's default units must keep the shared weight whole), and an EMA of its weights kept in every
snapshot (extra_state).

OWN_LM_RECORD=<folder> makes every training call of compute_loss append the ids of its batch to
<folder>/rank-<rank>.jsonl (with the process id, which tells a restarted job's attempts apart): the tests read
which samples each rank trained on.
"""

import json
import os

import torch
import torch.nn.functional as F
from torch import nn

WIDTH, HEADS, BLOCKS = 32, 2, 2
WARMUP_STEPS = 5


class Block(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
        self.dropout = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(batch, length, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.dropout(self.proj(attended.transpose(1, 2).reshape(batch, length, width)))
        return x + self.dropout(self.mlp(self.norm2(x)))


class TinyLM(nn.Module):
    def __init__(self, vocab_size: int, max_length: int):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocab_size, WIDTH), nn.Embedding(max_length, WIDTH)
        self.blocks = nn.ModuleList(Block(WIDTH, HEADS) for _ in range(BLOCKS))
        self.norm, self.head = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, vocab_size)
        self.head.weight = self.tokens.weight  # tied, as in most causal LMs

    def forward(self, input_ids, attention_mask=None, labels=None) -> dict[str, torch.Tensor]:
        # Padding is on the right, so causal attention keeps every real token from seeing it: the mask adds nothing.
        x = self.tokens(input_ids) + self.positions(torch.arange(input_ids.shape[1], device=input_ids.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        if labels is None:
            return {"logits": logits}
        return {"logits": logits, "loss": F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())}


def build_model(cfg, train_dataset) -> nn.Module:
    return TinyLM(train_dataset.vocab_size, train_dataset.max_length)


def compute_loss(model: nn.Module, batch: dict) -> dict[str, torch.Tensor]:
    """SUMS over the next-token targets that are not padding, and their count: the trainer divides."""
    if model.training and os.environ.get("OWN_LM_RECORD"):
        record(batch["id"].tolist())
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])["logits"][:, :-1]
    targets = batch["labels"][:, 1:]
    real = targets != -100
    return {
        "loss": F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="sum"),
        "count": real.sum(),
        "correct": ((logits.argmax(-1) == targets) & real).sum(),
    }


def record(ids: list[int]) -> None:
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    line = json.dumps({"pid": os.getpid(), "ids": ids}) + "\n"
    with open(os.path.join(os.environ["OWN_LM_RECORD"], f"rank-{rank}.jsonl"), "a") as handle:
        handle.write(line)  # one write, flushed on close: a SIGKILL leaves whole lines


def build_optimizer(cfg, model: nn.Module) -> torch.optim.Optimizer:
    """AdamW; no weight decay on biases and LayerNorm weights (parameters of fewer than 2 dimensions)."""
    parameters = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in parameters if p.ndim >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in parameters if p.ndim < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=cfg.lr)


def build_scheduler(cfg, optimizer: torch.optim.Optimizer, total_steps: int) -> torch.optim.lr_scheduler.LRScheduler:
    """Linear warmup over WARMUP_STEPS steps, then linear decay to 10% of the peak at total_steps."""

    def factor(step: int) -> float:
        if step < WARMUP_STEPS:
            return (step + 1) / WARMUP_STEPS
        return 1.0 - 0.9 * min(1.0, (step - WARMUP_STEPS) / max(1, total_steps - WARMUP_STEPS))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


class EMA:
    """An exponential moving average of the weights (of their shards, under fsdp, where AveragedModel's deepcopy of
    the model is refused), with state_dict() and load_state_dict(): a snapshot part."""

    def __init__(self, model: nn.Module, decay: float = 0.9):
        self.model, self.decay = model, decay
        self.average = {name: p.detach().clone() for name, p in model.named_parameters()}
        self.updates = 0

    @torch.no_grad()
    def update(self) -> None:
        for name, parameter in self.model.named_parameters():
            self.average[name].lerp_(parameter.detach(), 1 - self.decay)
        self.updates += 1

    def state_dict(self) -> dict:
        return {**self.average, "updates": self.updates}

    def load_state_dict(self, state: dict) -> None:
        for name, value in self.average.items():
            value.copy_(state[name])
        self.updates = int(state["updates"])


def extra_state(cfg, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The EMA of the weights, updated after every optimizer step, saved in every snapshot and resumed."""
    ema = EMA(model)
    optimizer.register_step_post_hook(lambda *args: ema.update())
    return {"ema": ema}
