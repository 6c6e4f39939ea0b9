"""``algenta generate``: decode from a HuggingFace checkpoint (Qwen3, Llama, Qwen2, Mistral,
Gemma 2/3) with a resident session.

    algenta generate --model DIR (--prompt TEXT | --ids 1,2,3) [--max-new N] [--temperature T]
                     [--top-k K] [--top-p P] [--seed S] [--max-ctx N] [--device cpu|cuda|auto]

Text prompts are tokenized with the ``tokenizers`` package (an optional extra) from the
checkpoint's ``tokenizer.json``; the generated text is streamed to stdout as it is produced (ids
instead with --ids), and the timing (prefill, decode tokens/s) goes to stderr at the end. Decoding
stops at the checkpoint's eos ids unless --ignore-eos. A bad path or a malformed checkpoint exits
2 with one line.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from .cli import CliError
from .residentk.config import read_json_file


def _bounded(kind, low, name):
    """An argparse type: `kind` values >= low (> 0 for low=None); ints within int64, since no
    count or seed past it means anything (argparse reports the refusal in one line)."""
    def conv(text):
        try:
            v = kind(text)
        except ValueError:
            raise ValueError(text) from None
        if not (v > 0 if low is None else v >= low) or (kind is int and v >= 2**63):
            raise ValueError(text)
        return v

    conv.__name__ = name
    return conv


_positive_int = _bounded(int, None, "positive int")
_count = _bounded(int, 0, "non-negative int")


def _ids(text):
    parts = [p.strip() for p in text.split(",")]
    if parts == [""]:
        raise CliError("--ids is empty")
    if "" in parts:
        raise CliError(f"--ids must be comma-separated integers with none empty, got {text!r}")
    try:
        return [int(p) for p in parts]
    except ValueError:
        raise CliError(f"--ids must be comma-separated integers, got {text!r}") from None


def register(subparsers) -> None:
    from .residentk.contract import RESIDENT_KV_FORMATS, RESIDENT_WEIGHT_FORMATS

    p = subparsers.add_parser(
        "generate", help="decode from a checkpoint with a resident session",
        description="Decode from a HuggingFace checkpoint directory (Qwen3, Llama, Qwen2, "
                    "Mistral, Gemma 2 or 3) with a resident session (weights and a "
                    "fixed-capacity KV cache held for the whole run).")
    p.add_argument("--model", required=True, metavar="PATH",
                   help="checkpoint directory (config.json + model.safetensors or an index), "
                        "or a llama.cpp .gguf file (Qwen3, Qwen2, Llama)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", metavar="TEXT", help="text prompt (needs tokenizer.json and "
                                                      "the 'tokenizers' package)")
    src.add_argument("--ids", metavar="1,2,3", help="comma-separated prompt token ids")
    p.add_argument("--max-new", type=_count, default=64, metavar="N", help="new tokens (default 64)")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T",
                   help="0 (the default) decodes greedily")
    p.add_argument("--top-k", type=_positive_int, default=None, metavar="K")
    p.add_argument("--top-p", type=float, default=None, metavar="P")
    p.add_argument("--seed", type=_count, default=None, metavar="S",
                   help="sampling seed (>= 0)")
    p.add_argument("--max-ctx", type=_positive_int, default=None, metavar="N",
                   help="session capacity request (default: prompt + max-new, at least 512)")
    p.add_argument("--device", choices=("cpu", "cuda", "auto"), default="cpu")
    p.add_argument("--weights", choices=RESIDENT_WEIGHT_FORMATS, default=None,
                   help="how the weight matrices are held resident (default f32, a GGUF file's "
                        "as stored; bf16/f16 halve the bytes each token reads, int8 about "
                        "quarters them)")
    p.add_argument("--kv", choices=RESIDENT_KV_FORMATS, default="f32",
                   help="how the KV cache holds keys and values (default f32; bf16/f16 halve "
                        "its memory)")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at the eos ids")
    p.set_defaults(handler=run)


def _eos_ids(root: Path) -> set:
    ids = set()
    for name in ("generation_config.json", "config.json"):
        try:
            v = read_json_file(root / name, name).get("eos_token_id")
        except (OSError, ValueError, AttributeError):  # ResidentError (607) is a ValueError
            continue
        for x in v if isinstance(v, list) else [v]:
            if isinstance(x, int) and not isinstance(x, bool):
                ids.add(x)
    return ids


class ModelPath:
    """What --model names: a checkpoint directory or a GGUF file (its header read and checked
    here, nothing allocated), with the session format, tokenizer and eos ids each one gives
    (the server reads a GGUF file's chat template from ``.gguf``)."""

    def __init__(self, path):
        from .errors import AlgentaError
        from .residentk.gguf_model import is_gguf, open_gguf

        self.root = Path(path)
        self.gguf = None
        if is_gguf(self.root):
            try:
                self.gguf = open_gguf(self.root)
            except AlgentaError as e:
                raise CliError(str(e)) from None
        elif not self.root.is_dir():
            raise CliError(f"{self.root}: not a checkpoint directory or a GGUF file")

    def weights(self, asked):
        """The session format: `asked`, else f32 for a directory and the stored one for GGUF."""
        if self.gguf is None:
            return asked or "f32"
        from .errors import AlgentaError

        try:
            return self.gguf.check_format(asked)
        except AlgentaError as e:
            raise CliError(f"{e} (--weights)") from None

    def tokenizer(self, **kw):
        if self.gguf is None:
            return _tokenizer(self.root, **kw)
        from .errors import AlgentaError

        try:
            return self.gguf.tokenizer()
        except ImportError:
            raise CliError(f"the 'tokenizers' package is not installed ({kw.get('why', '')})")
        except AlgentaError as e:
            raise CliError(str(e)) from None

    def eos_ids(self) -> set:
        return self.gguf.eos_ids() if self.gguf is not None else _eos_ids(self.root)


def _tokenizer(root: Path, *, why="--prompt needs it", instead="pass token ids with --ids"):
    path = root / "tokenizer.json"
    if not path.is_file():
        raise CliError(f"{root} has no tokenizer.json ({why}): {instead}")
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise CliError(f"the 'tokenizers' package is not installed ({why}; pip install "
                       f"tokenizers): {instead}") from None
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # the tokenizers package raises its own exception types
        raise CliError(f"{path}: cannot be read as a tokenizer ({e})") from None


def run(args) -> int:
    from .errors import AlgentaError
    from .residentk.session import ResidentSession

    from .residentk.contract import RESIDENT_MAX_CONTEXT, residentk_context_check

    model = ModelPath(args.model)
    root = model.root
    weights = model.weights(args.weights)
    tok = None
    if args.prompt is not None:
        tok = model.tokenizer()
        prompt = tok.encode(args.prompt).ids
        if not prompt:
            raise CliError("the prompt encodes to no tokens")
    else:
        prompt = _ids(args.ids)
    max_ctx = args.max_ctx or max(512, len(prompt) + args.max_new)
    # Before the checkpoint is read: a run that cannot fit is refused at once.
    st = residentk_context_check(len(prompt), args.max_new, max_ctx)
    if st == 602:
        what = f"--max-ctx {max_ctx}" if args.max_ctx else \
            f"a prompt of {len(prompt)} tokens plus --max-new {args.max_new}"
        raise CliError(f"{what} is past the largest context a session holds, "
                       f"{RESIDENT_MAX_CONTEXT} (status 602)")
    if st != 600:
        raise CliError(f"a prompt of {len(prompt)} tokens plus --max-new {args.max_new} does not "
                       f"fit --max-ctx {max_ctx} (status {st})")

    try:
        t0 = time.perf_counter()
        session = ResidentSession.from_pretrained(root, max_ctx=max_ctx, device=args.device,
                                                  weights=weights, kv=args.kv)
        t_load = time.perf_counter() - t0
    except (AlgentaError, FileNotFoundError) as e:
        raise CliError(str(e)) from None

    out = sys.stdout
    produced = []
    times = []
    shown = ""

    def on_token(t):
        times.append(time.perf_counter())
        produced.append(t)
        nonlocal shown
        if tok is None:
            out.write(("" if len(produced) == 1 else " ") + str(t))
        else:
            # Decode the whole tail and print what is new: one token can end mid-character
            # (byte-level BPE), which decodes to U+FFFD until the next token completes it.
            text = tok.decode(produced)
            if not text.endswith("\ufffd"):
                out.write(text[len(shown):] if text.startswith(shown) else text)
                shown = text
        out.flush()

    if tok is not None:
        out.write(args.prompt)
        out.flush()
    stop = () if args.ignore_eos else tuple(model.eos_ids())
    try:
        t1 = time.perf_counter()
        session.generate(prompt, args.max_new, temperature=args.temperature, top_k=args.top_k,
                         top_p=args.top_p, seed=args.seed, stop_ids=stop, on_token=on_token)
    except AlgentaError as e:
        raise CliError(str(e)) from None
    out.write("\n")
    out.flush()
    n = len(produced)
    msg = f"loaded in {t_load:.2f} s; prompt {len(prompt)} tokens"
    if n:
        msg += f", prefill {times[0] - t1:.3f} s"
    if n > 1:
        dt = times[-1] - times[0]
        msg += f"; {n} new tokens, decode {(n - 1) / dt:.1f} tokens/s"
    print(f"{msg} ({session.device}, weights {session.weights}, kv {session.kv}, "
          f"{session.dispatches_per_token} stages/token)",
          file=sys.stderr)
    return 0
