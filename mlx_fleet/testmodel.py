"""Generate a tiny but real MLX language model for development and tests.

The model is a llama-architecture network with random weights (``model.safetensors``) and a real
byte-level BPE tokenizer trained on a small built-in English corpus (``tokenizer.json`` +
``tokenizer_config.json`` with a chat template). It is loaded by exactly the same code path as a
downloaded model: ``mlx_lm.load(str(path))``.

No network access is needed, output is deterministic for a given seed and parameters, and
calling :func:`make_test_model` again on a complete model directory with the same parameters
returns at once.

CLI: ``mlx-fleet make-test-model DIR [--hidden-size N] [--num-layers N] [--vocab-size N]
[--seed N] [--force]`` (wired through :func:`add_arguments` / :func:`run`; :func:`main` runs it
stand-alone).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Sequence

__all__ = ["make_test_model", "add_arguments", "run", "main", "MARKER_FILE", "CORPUS"]

#: File written last into a finished model directory; holds the generation parameters.
MARKER_FILE = "mlx-fleet-testmodel.json"
_FORMAT_VERSION = 1

BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
PAD_TOKEN = "<pad>"
UNK_TOKEN = "<unk>"
_SPECIAL_TOKENS = [PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN, "<|user|>", "<|assistant|>",
                   "<|system|>"]

#: A simple role-tagged chat template (Jinja, as Hugging Face tokenizers use it).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

#: The built-in English corpus the tokenizer is trained on.
CORPUS = """\
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step.
Hello, world! How are you today? I am fine, thank you. What is your name? My name is Fleet.
Machine learning models run on Apple Silicon Macs with unified memory and a fast GPU.
Kubernetes schedules workloads onto nodes; an operator watches resources and reconciles state.
The agent loads the model, serves requests over HTTP, and reports health and metrics.
Once upon a time there was a little robot who wanted to learn how to write poems about the sea.
The sun rises in the east and sets in the west. Water boils at one hundred degrees Celsius.
Please write a short story about a cat, a dog, and a bird who become friends in the city.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 100 1000 2024 3.14 42. Letters: a b c d e f g h i j k l m
n o p q r s t u v w x y z. Punctuation: . , ; : ! ? ' " ( ) [ ] { } - _ / + = * & % $ # @.
Questions and answers: Why is the sky blue? Because sunlight scatters off the air molecules.
Where do you live? I live in a small house near the river, with a garden full of flowers.
Every morning she reads the news, drinks a cup of coffee, and walks to the office by the park.
Good software is simple, tested, and documented. Small commits make reviews easy and safe.
The canary release sends a small share of traffic to the new revision before promoting it.
If the error rate rises, the rollback returns all traffic to the stable version within seconds.
Tokens are generated one at a time; each new token depends on all the tokens that came before.
They went to the market to buy apples, bread, cheese, milk, eggs, tomatoes, and fresh fish.
In the winter the days are short and cold; in the summer they are long, warm, and bright.
Thank you very much for your help. You are welcome. See you tomorrow. Have a nice day!
"""


def _params(hidden_size: int, num_layers: int, vocab_size: int, seed: int, num_heads: int,
            intermediate_size: int) -> dict:
    return {
        "format_version": _FORMAT_VERSION,
        "hidden_size": hidden_size,
        "num_layers": num_layers,
        "vocab_size": vocab_size,
        "seed": seed,
        "num_heads": num_heads,
        "intermediate_size": intermediate_size,
    }


def _write_bytes_atomic(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _build_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=_SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # The trainer is deterministic for a fixed corpus; repeating the lines gives merges stable
    # frequencies.
    tok.train_from_iterator(CORPUS.splitlines() * 4, trainer=trainer)
    return tok


def make_test_model(
    dest: str | os.PathLike,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    vocab_size: int = 512,
    seed: int = 0,
    num_heads: int = 4,
    intermediate_size: int | None = None,
    force: bool = False,
) -> Path:
    """Write a small real MLX llama model into ``dest`` and return ``dest`` as a ``Path``.

    Args:
        dest: target directory (created if missing).
        hidden_size: model width in features (must be divisible by ``num_heads``).
        num_layers: number of transformer blocks.
        vocab_size: target tokenizer vocabulary size in tokens (>= 300: 256 byte tokens plus
            specials plus merges). The BPE trainer may stop earlier on the small corpus; the
            model's ``vocab_size`` equals the tokenizer's actual size.
        seed: seed of MLX's random generator for the weights.
        num_heads: attention heads (key/value heads equal it).
        intermediate_size: MLP width in features (default ``2 * hidden_size``).
        force: regenerate even if ``dest`` already holds a complete model with these parameters.

    Files: ``config.json``, ``model.safetensors`` (float32 weights), ``tokenizer.json``,
    ``tokenizer_config.json``, ``special_tokens_map.json``, ``generation_config.json`` and the
    marker ``mlx-fleet-testmodel.json`` (written last).

    The output-projection row of the EOS token is zero, so a greedy decode practically never
    ends by EOS: tests can rely on ``max_tokens`` / stop strings to end generations.

    Raises ``ValueError`` for inconsistent sizes.
    """
    if intermediate_size is None:
        intermediate_size = 2 * hidden_size
    if hidden_size < 8 or hidden_size % num_heads or (hidden_size // num_heads) % 2:
        raise ValueError("hidden_size must be >= 8 and divisible by num_heads into an even head dim")
    if num_layers < 1:
        raise ValueError("num_layers must be >= 1")
    if vocab_size < 300:
        raise ValueError("vocab_size must be >= 300 (byte alphabet + special tokens)")

    dest = Path(dest)
    params = _params(hidden_size, num_layers, vocab_size, seed, num_heads, intermediate_size)
    marker = dest / MARKER_FILE
    if not force and marker.is_file():
        try:
            if json.loads(marker.read_text()) == params and all(
                (dest / f).is_file() for f in ("config.json", "model.safetensors",
                                               "tokenizer.json", "tokenizer_config.json")
            ):
                return dest
        except (OSError, ValueError):
            pass
    dest.mkdir(parents=True, exist_ok=True)
    marker.unlink(missing_ok=True)

    # -- tokenizer -----------------------------------------------------------------------------
    tok = _build_tokenizer(vocab_size)
    real_vocab = tok.get_vocab_size()
    eos_id = tok.token_to_id(EOS_TOKEN)
    bos_id = tok.token_to_id(BOS_TOKEN)
    pad_id = tok.token_to_id(PAD_TOKEN)
    _write_bytes_atomic(dest / "tokenizer.json", tok.to_str(pretty=True).encode())
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": UNK_TOKEN,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
        "chat_template": CHAT_TEMPLATE,
    }
    _write_bytes_atomic(dest / "tokenizer_config.json", json.dumps(tok_config, indent=2).encode())
    _write_bytes_atomic(dest / "special_tokens_map.json", json.dumps({
        "bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN,
        "unk_token": UNK_TOKEN}, indent=2).encode())

    # -- model ---------------------------------------------------------------------------------
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden_size,
        "num_hidden_layers": num_layers,
        "intermediate_size": intermediate_size,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_heads,
        "head_dim": hidden_size // num_heads,
        "rms_norm_eps": 1e-5,
        "vocab_size": real_vocab,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
        "torch_dtype": "float32",
    }
    _write_bytes_atomic(dest / "config.json", json.dumps(config, indent=2).encode())
    _write_bytes_atomic(dest / "generation_config.json", json.dumps(
        {"bos_token_id": bos_id, "eos_token_id": eos_id, "pad_token_id": pad_id}).encode())

    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    weights = dict(tree_flatten(model.parameters()))
    head = weights["lm_head.weight"]
    weights["lm_head.weight"] = mx.where(
        (mx.arange(head.shape[0]) == eos_id)[:, None], mx.zeros_like(head), head)
    mx.eval(weights)
    fd, tmp = tempfile.mkstemp(dir=dest, prefix=".model.", suffix=".safetensors")
    os.close(fd)
    try:
        mx.save_safetensors(tmp, weights, metadata={"format": "mlx"})
        os.replace(tmp, dest / "model.safetensors")
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise

    _write_bytes_atomic(marker, json.dumps(params, indent=2).encode())
    return dest


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``make-test-model`` arguments to ``parser``."""
    parser.description = (
        "Write a tiny real MLX model (llama architecture, random weights, byte-level BPE "
        "tokenizer trained on a built-in English corpus) into DIR. It loads with "
        "mlx_lm.load(DIR) like any downloaded model. Deterministic for a seed; a second run "
        "with the same parameters returns at once.")
    parser.add_argument("dir", metavar="DIR", help="target directory (created if missing)")
    parser.add_argument("--hidden-size", type=int, default=64, help="model width (default 64)")
    parser.add_argument("--num-layers", type=int, default=2,
                        help="transformer blocks (default 2)")
    parser.add_argument("--vocab-size", type=int, default=512,
                        help="tokenizer vocabulary size in tokens (default 512)")
    parser.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    parser.add_argument("--force", action="store_true",
                        help="regenerate even if DIR already holds this model")


def run(args: argparse.Namespace) -> int:
    """Run the command for parsed ``args``; prints the model path; returns the exit code."""
    try:
        path = make_test_model(Path(args.dir), hidden_size=args.hidden_size,
                               num_layers=args.num_layers, vocab_size=args.vocab_size,
                               seed=args.seed, force=args.force)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # e.g. DIR is an existing file, or not writable
        print(f"error: cannot write the model to {args.dir}: {e.strerror or e}", file=sys.stderr)
        return 1
    print(path)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Stand-alone entry point: ``python -m mlx_fleet.testmodel DIR``."""
    parser = argparse.ArgumentParser(prog="mlx-fleet make-test-model")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
