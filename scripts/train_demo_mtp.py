"""Train an MTP head for the embedded demo model and write demo + head to a new directory, to
measure speculative decoding with a head that predicts something (a random head drafts nothing
the model accepts). The demo itself is left as it is.

    python scripts/train_demo_mtp.py OUT_DIR [--steps 300] [--seed 0]
    python -m atlas.run --model OUT_DIR --spec-k 2      # stats line: acceptance, tokens/pass

The head is trained as it is used: at position i it reads the token at i+1 and the demo's
final-normed hidden state at i and predicts the token at i+2 (teacher-forced over the demo's
text), with the demo's embedding and lm_head frozen.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "python"))

from atlas.demo import DEMO_DIR, zen_of_python  # noqa: E402
from atlas.oracle_mtp import TorchMtpHead  # noqa: E402
from atlas.tokenizer import Tokenizer  # noqa: E402


def initialise(head: TorchMtpHead, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in head.named_parameters():
            if name.endswith("norm.weight"):
                param.zero_()  # zero-centred norms: scale 1
            else:
                param.copy_(torch.randn(param.shape, generator=gen) / param.shape[-1] ** 0.5)


def train(out_dir: Path, steps: int, seed: int) -> None:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(DEMO_DIR, dtype=torch.float32).eval()
    ids = torch.tensor(Tokenizer.open(DEMO_DIR).encode(zen_of_python()))  # [N]
    with torch.no_grad():
        hidden = model.model(input_ids=ids[None]).last_hidden_state[0]  # [N, H], final-normed
        embedded = model.model.embed_tokens(ids[1:-1])  # [N-2, H]: tokens at i+1
    head = TorchMtpHead(DEMO_DIR)
    initialise(head, seed)
    optimiser = torch.optim.Adam(head.parameters(), lr=3e-3)
    for step in range(steps):
        logits = model.lm_head(head(embedded, hidden[:-2]))  # [N-2, V]: predicts tokens at i+2
        loss = torch.nn.functional.cross_entropy(logits, ids[2:])
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
        if step % 50 == 0 or step == steps - 1:
            accuracy = (logits.argmax(-1) == ids[2:]).float().mean().item()
            print(f"step {step}: loss {loss.item():.3f}, next-next accuracy {accuracy:.1%}")
    write(out_dir, head)


def write(out_dir: Path, head: TorchMtpHead) -> None:
    from safetensors.torch import load_file, save_file

    shutil.copytree(DEMO_DIR, out_dir, ignore=shutil.ignore_patterns("*.py", "*.md", "__pycache__"))
    path = out_dir / "model.safetensors"
    tensors = load_file(path)
    for name, value in head.state_dict().items():
        if not name.startswith("rotary."):
            tensors[f"mtp.{name}"] = value.detach().to(torch.bfloat16).contiguous()
    save_file(tensors, path, metadata={"format": "pt"})
    print(f"wrote {out_dir}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.out_dir.exists():
        sys.exit(f"{args.out_dir} exists; choose a new directory")
    train(args.out_dir, args.steps, args.seed)


if __name__ == "__main__":
    main()
