"""Does a released Qwen3 shape fine-tune in this machine's memory? One run, not a
computation: writes a random Hugging Face folder of the shape (bf16, tensor by tensor,
2 GiB shards: the folder is never whole in memory), then runs bench_memory's case on
it in a fresh process (``model.hf`` loaded as a run loads it, one training step after
an untimed one) and prints the process's peaks.

    python benchmarks/bench_fit.py --shape qwen3-8b --case qlora_fused --ac

The weights are random (normal, std 0.02): memory and speed do not depend on the values.
``--keep DIR`` writes the folder there and reuses it on the next call.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SHAPES = {  # the released config.json values that decide memory (vocab 151936, head_dim 128)
    "qwen3-1.7b": {"hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 28,
                   "num_attention_heads": 16, "num_key_value_heads": 8, "tie_word_embeddings": True},
    "qwen3-4b": {"hidden_size": 2560, "intermediate_size": 9728, "num_hidden_layers": 36,
                 "num_attention_heads": 32, "num_key_value_heads": 8, "tie_word_embeddings": True},
    "qwen3-8b": {"hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
                 "num_attention_heads": 32, "num_key_value_heads": 8, "tie_word_embeddings": False},
    "qwen3-14b": {"hidden_size": 5120, "intermediate_size": 17408, "num_hidden_layers": 40,
                  "num_attention_heads": 40, "num_key_value_heads": 8, "tie_word_embeddings": False},
}
SHARD_BYTES = 2 << 30


def write_folder(folder: Path, shape: str) -> int:
    """config.json and random bf16 safetensors shards with an index; returns the
    parameter count. Tensor names and shapes come from transformers' model on meta."""
    import torch
    import transformers
    from safetensors.torch import save_file

    config = transformers.Qwen3Config(head_dim=128, vocab_size=151936, max_position_embeddings=4096,
                                      eos_token_id=0, **SHAPES[shape])
    with torch.device("meta"):
        model = transformers.Qwen3ForCausalLM(config)
    names = {k: v.shape for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        names.pop("lm_head.weight", None)
    folder.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(folder)
    gen = torch.Generator().manual_seed(0)
    weight_map, shard, size, count, index = {}, {}, 0, 0, 0

    def flush():
        nonlocal shard, size, index
        if shard:
            index += 1
            name = f"model-{index:05d}.safetensors"
            save_file(shard, str(folder / name), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, name))
            shard, size = {}, 0

    for name, shape_ in names.items():
        t = torch.empty(shape_, dtype=torch.bfloat16)
        if name.endswith("norm.weight"):
            t.fill_(1.0)
        else:
            t.normal_(0.0, 0.02, generator=gen)
        shard[name] = t
        size += t.numel() * 2
        count += t.numel()
        if size >= SHARD_BYTES:
            flush()
    flush()
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": count * 2}, "weight_map": weight_map}))
    return count


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), required=True)
    p.add_argument("--case", default="qlora_fused", choices=("lora_fused", "qlora_fused"))
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--ac", action="store_true")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--keep", help="write (or reuse) the folder here instead of a temporary one")
    args = p.parse_args(argv)
    tmp = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="bench-fit-"))
    folder = tmp / args.shape
    try:
        if not (folder / "model.safetensors.index.json").is_file():
            params = write_folder(folder, args.shape)
            print(f"wrote {folder.name}: {params / 1e9:.2f} B parameters", flush=True)
        cmd = [sys.executable, str(Path(__file__).with_name("bench_memory.py")), "--case", args.case,
               f"--base={folder}", f"--seq={args.seq}", "--steps=1", f"--threads={args.threads}",
               "--dtype=bfloat16"] + (["--ac"] if args.ac else [])
        run = subprocess.run(cmd, capture_output=True, text=True)
        if run.returncode:
            print(f"{args.case}: failed: {run.stderr.strip().splitlines()[-1]}")
            return 1
        row = json.loads(run.stdout.strip().splitlines()[-1])
        print(json.dumps({"shape": args.shape, "ac": args.ac, **row}))
        gib = 1 << 10
        print(f"{args.shape} {args.case} (bf16 base, seq {args.seq}, ac={args.ac}): train peak "
              f"{row['train_peak_mib'] / gib:.1f} GiB, process peak {row['process_peak_mib'] / gib:.1f} GiB, "
              f"{row['step_s']:.0f} s a step")
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
