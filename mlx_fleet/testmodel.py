"""Generate a tiny but real MLX language model for development and tests.

The model is a llama-architecture network with random weights (``model.safetensors``) and a real
byte-level BPE tokenizer trained on a small built-in English corpus (``tokenizer.json`` +
``tokenizer_config.json`` with a chat template). It is loaded by exactly the same code path as a
downloaded model: ``mlx_lm.load(str(path))``.

Embedding models: ``make_test_model(dir, embedding=True)`` writes a ``qwen3``-architecture
decoder laid out as Qwen3-Embedding is (whose ``config.json`` is a plain ``Qwen3ForCausalLM``):
the sentence-transformers ``modules.json`` and ``1_Pooling/config.json`` (last-token pooling,
then Normalize), vLLM's ``is_matryoshka: true`` in ``config.json``, and a tokenizer that appends
EOS to every text. Served with ``spec.model.task: TextEmbedding``
(:mod:`node_agent.serving.embed_profile` reads those files), loaded through the same path.

No network access is needed, output is deterministic for a given seed and parameters, and
calling :func:`make_test_model` again on a complete model directory with the same parameters
returns at once.

Faulty models (for canary tests): ``make_test_model(dir, fault=Fault("raise", after_tokens=N))``
writes a model whose every generation fails on the server side after exactly ``N`` generated
tokens, for any text prompt, greedy or sampled. The fault is pure data in the model's files (no
Python code is loaded from the model directory; ``trust_remote_code`` stays off):

* Weights: every attention and MLP output projection is zero, so the residual stream holds only
  the current token's embedding and the next token depends on the current token alone. The
  embedding and ``lm_head`` rows then encode a fixed chain: any token of the ordinary vocabulary
  is followed by ``step1``, ``step1`` by ``step2`` ... and ``stepN`` by the *poisoned* token
  (logit margin about 1000, so even sampling at temperature 2 follows the chain; EOS never wins).
  The ``stepK`` tokens are vocabulary entries that no merge produces, so no text prompt can end
  in one and shift the count.
* Tokenizer: the poisoned id is a hole in the BPE vocabulary (no string has it; one filler
  entry sits above it so it stays below ``len(tokenizer)``). mlx-lm's streaming detokenizer
  (``BPEStreamingDetokenizer``, chosen for the ``ByteLevel`` decoder) maps ids to strings with
  ``convert_ids_to_tokens``, which gives ``None`` for the hole, so ``add_token(poisoned)``
  raises ``TypeError``. That is what a server feeding each generated token to
  ``tokenizer.detokenizer`` (like the node agent) hits on the ``N+1``-th token. The first ``N``
  tokens detokenize normally (text ``"step1 step2 ... stepN"``).

A *stall* (tokens stop coming) cannot be made from data alone: the per-token compute is fixed by
the shapes in ``config.json``, and the only data-dependent work per token is the Python
detokenizer, which could at best be slowed down by megabyte-long token strings; that blocks the
server's whole MLX thread (every model on the node), not one request.

CLI: ``mlx-fleet make-test-model DIR [--hidden-size N] [--num-layers N] [--vocab-size N]
[--seed N] [--fault raise --fault-after-tokens N] [--embedding] [--force]`` (wired through
:func:`add_arguments` / :func:`run`; :func:`main` runs it stand-alone).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

__all__ = ["make_test_model", "Fault", "FAULT_KINDS", "MAX_FAULT_AFTER_TOKENS", "add_arguments",
           "run", "main", "MARKER_FILE", "CORPUS"]

#: File written last into a finished model directory; holds the generation parameters.
MARKER_FILE = "mlx-fleet-testmodel.json"
_FORMAT_VERSION = 2   # 2: the chat template renders tools and tool calls (issue 20)

BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
PAD_TOKEN = "<pad>"
UNK_TOKEN = "<unk>"
_SPECIAL_TOKENS = [PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN, "<|user|>", "<|assistant|>",
                   "<|system|>"]

#: A simple role-tagged chat template (Jinja, as Hugging Face tokenizers use it). With
#: ``tools`` it lists them in a system turn and renders an assistant's ``tool_calls`` in the
#: Qwen/Hermes form ``<tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>`` (mlx-lm
#: infers its ``json_tools`` tool parser from ``<tool_call>`` and ``tool_call.name`` here); tool
#: results are ``<|tool|>`` turns. Without tools the rendering is the plain role-tagged one.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|system|>\n# Tools\n{% for tool in tools %}{{ tool | tojson }}\n"
    "{% endfor %}Call a tool as <tool_call>\n{\"name\": <name>, \"arguments\": <args>}\n"
    "</tool_call>{{ eos_token }}\n{% endif %}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}"
    "{% for tool_call in message.tool_calls or [] %}"
    "{% if tool_call.function is defined %}{% set tool_call = tool_call.function %}{% endif %}"
    "<tool_call>\n{\"name\": \"{{ tool_call.name }}\", \"arguments\": "
    "{% if tool_call.arguments is string %}{{ tool_call.arguments }}"
    "{% else %}{{ tool_call.arguments | tojson }}{% endif %}}\n</tool_call>"
    "{% endfor %}{{ eos_token }}\n"
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


#: Fault kinds :class:`Fault` accepts.
FAULT_KINDS = ("raise",)
#: Largest ``Fault.after_tokens`` (the model's ``max_position_embeddings``).
MAX_FAULT_AFTER_TOKENS = 4096

#: Logit of the next chain token; every other token's logit is far below (see _chain_codes).
_CHAIN_LOGIT = 1000.0
#: Smallest allowed gap between the chain token's logit and any other (sampling at temperature
#: T sees gap / T; the Gumbel noise of categorical sampling spans about 20 in float32).
_MIN_CHAIN_MARGIN = 100.0
#: Text of the K-th chain token (byte-level form: "Ġ" is the space). Letters next to digits never
#: form one pre-token, so the trained vocabulary cannot hold these strings.
_CHAIN_TOKEN = "\u0120step{}"
#: The vocabulary entry right above the poisoned id (keeps the hole below len(tokenizer)).
_FILLER_TOKEN = "<|mlx-fleet-fault-filler|>"


@dataclass(frozen=True)
class Fault:
    """A fault built into a generated test model's files (see the module docstring).

    ``kind="raise"``: every generation fails after exactly ``after_tokens`` generated tokens:
    the next generated token is one that mlx-lm's streaming detokenizer cannot handle
    (``TokenizerWrapper.detokenizer.add_token`` raises ``TypeError``). ``after_tokens=0`` fails
    on the first generated token.
    """

    kind: str
    after_tokens: int

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"unknown fault kind {self.kind!r} (known: {', '.join(FAULT_KINDS)})")
        if (not isinstance(self.after_tokens, int) or isinstance(self.after_tokens, bool)
                or not 0 <= self.after_tokens <= MAX_FAULT_AFTER_TOKENS):
            raise ValueError(f"fault after_tokens must be an integer from 0 to "
                             f"{MAX_FAULT_AFTER_TOKENS}, not {self.after_tokens!r}")

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "after_tokens": self.after_tokens}


def _params(hidden_size: int, num_layers: int, vocab_size: int, seed: int, num_heads: int,
            intermediate_size: int, fault: Fault | None = None,
            embedding: bool = False) -> dict:
    params: dict[str, Any] = {
        "format_version": _FORMAT_VERSION,
        "hidden_size": hidden_size,
        "num_layers": num_layers,
        "vocab_size": vocab_size,
        "seed": seed,
        "num_heads": num_heads,
        "intermediate_size": intermediate_size,
    }
    if fault is not None:  # a healthy model's marker stays exactly what it always was
        params["fault"] = fault.to_dict()
    if embedding:
        params["embedding"] = True
    return params


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


def _faulty_tokenizer_json(tok: Any, after_tokens: int) -> bytes:
    """``tok``'s JSON plus the chain tokens ``step1..stepN`` (ids V..V+N-1), a hole at V+N (the
    poisoned id) and a filler entry at V+N+1, all plain BPE vocabulary entries that no merge
    produces (so encoding any text gives exactly the ids it gives with ``tok``)."""
    data = json.loads(tok.to_str())
    vocab = data["model"]["vocab"]
    base = tok.get_vocab_size()
    if sorted(vocab.values()) != list(range(base)):
        raise RuntimeError("the trained vocabulary is not contiguous")  # tokenizers changed
    new = [_CHAIN_TOKEN.format(k) for k in range(1, after_tokens + 1)]
    taken = set(vocab) | {t["content"] for t in data.get("added_tokens", [])}
    if taken & set(new + [_FILLER_TOKEN]):
        raise RuntimeError("a fault token collides with the trained vocabulary")
    for i, token in enumerate(new):
        vocab[token] = base + i
    vocab[_FILLER_TOKEN] = base + after_tokens + 1  # id base + after_tokens stays unassigned
    return json.dumps(data, indent=2, ensure_ascii=False).encode()


def _chain_codes(n: int, dim: int, seed: int) -> Any:
    """``n`` unit vectors of ``dim`` features, pairwise far apart: the identity's rows where
    they fit, else seeded random directions (checked for a sufficient logit margin)."""
    import mlx.core as mx

    if n <= dim:
        return mx.eye(dim, dtype=mx.float32)[:n]
    codes = mx.random.normal((n, dim), key=mx.random.key(seed))
    codes = codes / mx.linalg.norm(codes, axis=1, keepdims=True)
    cos = (codes @ codes.T - 2 * mx.eye(n)).max().item()
    if _CHAIN_LOGIT * (1 - cos) < _MIN_CHAIN_MARGIN:
        raise ValueError(f"a fault after {n - 1} tokens needs a larger hidden_size than {dim}")
    return codes


def _apply_fault(weights: dict[str, Any], base_vocab: int, after_tokens: int, hidden_size: int,
                 codes: Any) -> dict[str, Any]:
    """Rewrite healthy ``weights`` into the deterministic chain model (module docstring);
    ``codes``: :func:`_chain_codes` for ``after_tokens + 1`` states."""
    import mlx.core as mx

    n = after_tokens
    vocab = base_vocab + n + 2
    # State of an input token: 0 for every id except chain token K (id base_vocab + K - 1): K.
    state = mx.concatenate([mx.zeros(base_vocab, mx.int32), mx.arange(1, n + 1, dtype=mx.int32),
                            mx.zeros(2, mx.int32)])
    out = dict(weights)
    out["model.embed_tokens.weight"] = codes[state]
    # After the final RMSNorm a unit code vector c is sqrt(d) * c; the row of the token that
    # follows state s is (logit / sqrt(d)) * code[s]: state s < N -> chain token s + 1 (id
    # base_vocab + s), state N -> the poisoned id base_vocab + N. All other rows are zero.
    head = mx.zeros((vocab, hidden_size), dtype=mx.float32)
    head[base_vocab:base_vocab + n + 1] = codes * (_CHAIN_LOGIT / hidden_size ** 0.5)
    out["lm_head.weight"] = head
    for name, value in weights.items():
        if name.endswith((".self_attn.o_proj.weight", ".mlp.down_proj.weight")):
            out[name] = mx.zeros_like(value)
        elif name.endswith("norm.weight"):
            out[name] = mx.ones_like(value)
    return out


def _embedding_config() -> dict[str, Any]:
    """What an embedding model's ``config.json`` says beyond the llama test model's: the
    ``qwen3`` architecture as Qwen3-Embedding-0.6B's config (``Qwen3ForCausalLM``, tied word
    embeddings, no sliding window) and vLLM's Matryoshka marker ``is_matryoshka`` (Qwen3-
    Embedding is trained for it; its own config does not say so, vLLM users add it with
    ``--hf-overrides``)."""
    return {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"],
            "tie_word_embeddings": True, "attention_bias": False, "use_sliding_window": False,
            "is_matryoshka": True}


def _embedding_files(hidden_size: int) -> dict[str, bytes]:
    """The sentence-transformers files Qwen3-Embedding ships, which make a decoder an
    embedding model (read by :mod:`node_agent.serving.embed_profile`): ``modules.json``
    (Transformer → Pooling → Normalize) and ``1_Pooling/config.json`` (last-token pooling)."""
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling",
         "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize",
         "type": "sentence_transformers.models.Normalize"},
    ]
    pooling = {"word_embedding_dimension": hidden_size, "pooling_mode_cls_token": False,
               "pooling_mode_mean_tokens": False, "pooling_mode_max_tokens": False,
               "pooling_mode_mean_sqrt_len_tokens": False,
               "pooling_mode_weightedmean_tokens": False, "pooling_mode_lasttoken": True,
               "include_prompt": True}
    return {"modules.json": json.dumps(modules, indent=2).encode(),
            "1_Pooling/config.json": json.dumps(pooling, indent=2).encode()}


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
    fault: Fault | None = None,
    embedding: bool = False,
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
        fault: build this :class:`Fault` into the model (``None``: a healthy model, exactly as
            without the argument). A faulty model keeps the healthy one's tokenizer behaviour
            for text and its chat template; see the module docstring for how the fault works.
        embedding: write an embedding model instead, laid out as Qwen3-Embedding is (see
            :func:`_embedding_files`): a ``qwen3`` decoder (``Qwen3ForCausalLM``, tied
            embeddings, no LM head weights), ``is_matryoshka: true`` in ``config.json``, the
            sentence-transformers ``modules.json`` (Transformer → Pooling → Normalize) and
            ``1_Pooling/config.json`` (``pooling_mode_lasttoken``), and a tokenizer that appends
            EOS to every encoded text (Qwen3-Embedding's appends ``<|endoftext|>``). Deploy it
            with ``spec.model.task: TextEmbedding``.

    Files: ``config.json``, ``model.safetensors`` (float32 weights), ``tokenizer.json``,
    ``tokenizer_config.json``, ``special_tokens_map.json``, ``generation_config.json`` and the
    marker ``mlx-fleet-testmodel.json`` (written last).

    The output-projection row of the EOS token is zero, so a greedy decode practically never
    ends by EOS: tests can rely on ``max_tokens`` / stop strings to end generations.

    Raises ``ValueError`` for inconsistent sizes (or a fault chain too long for
    ``hidden_size``).
    """
    if intermediate_size is None:
        intermediate_size = 2 * hidden_size
    if hidden_size < 8 or hidden_size % num_heads or (hidden_size // num_heads) % 2:
        raise ValueError("hidden_size must be >= 8 and divisible by num_heads into an even head dim")
    if num_layers < 1:
        raise ValueError("num_layers must be >= 1")
    if vocab_size < 300:
        raise ValueError("vocab_size must be >= 300 (byte alphabet + special tokens)")

    if fault is not None and not isinstance(fault, Fault):
        raise TypeError("fault must be a Fault or None")
    if fault is not None and embedding:
        raise ValueError("a fault is built into generation models only, not an embedding model")
    # before any file is written: raises ValueError if the chain does not fit hidden_size
    codes = None if fault is None else _chain_codes(fault.after_tokens + 1, hidden_size, seed)

    dest = Path(dest)
    params = _params(hidden_size, num_layers, vocab_size, seed, num_heads, intermediate_size,
                     fault, embedding)
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
    if embedding:
        from tokenizers import processors

        tok.post_processor = processors.Sequence([
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(single=f"$A {EOS_TOKEN}", pair=f"$A {EOS_TOKEN} $B",
                                          special_tokens=[(EOS_TOKEN, eos_id)])])
    if fault is None:
        _write_bytes_atomic(dest / "tokenizer.json", tok.to_str(pretty=True).encode())
    else:
        _write_bytes_atomic(dest / "tokenizer.json",
                            _faulty_tokenizer_json(tok, fault.after_tokens))
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
    if embedding:
        config.update(_embedding_config())
    # The network's random weights are drawn for the healthy shapes in either case, so a faulty
    # model shares the healthy one's other weights; only its written vocabulary is larger.
    model_config = dict(config)
    if fault is not None:
        config["vocab_size"] = real_vocab + fault.after_tokens + 2
    _write_bytes_atomic(dest / "config.json", json.dumps(config, indent=2).encode())
    _write_bytes_atomic(dest / "generation_config.json", json.dumps(
        {"bos_token_id": bos_id, "eos_token_id": eos_id, "pad_token_id": pad_id}).encode())

    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama, qwen3

    mx.random.seed(seed)
    if embedding:
        for name, data in _embedding_files(hidden_size).items():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            _write_bytes_atomic(dest / name, data)
        model = qwen3.Model(qwen3.ModelArgs.from_dict(config))
        weights = dict(tree_flatten(model.parameters()))   # tied: no lm_head
    else:
        model = llama.Model(llama.ModelArgs.from_dict(model_config))
        weights = dict(tree_flatten(model.parameters()))
        head = weights["lm_head.weight"]
        weights["lm_head.weight"] = mx.where(
            (mx.arange(head.shape[0]) == eos_id)[:, None], mx.zeros_like(head), head)
    if fault is not None:
        weights = _apply_fault(weights, real_vocab, fault.after_tokens, hidden_size, codes)
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
        "with the same parameters returns at once. With --fault it writes a faulty model for "
        "canary tests instead (the fault is data in the model's files, no code).")
    parser.add_argument("dir", metavar="DIR", help="target directory (created if missing)")
    parser.add_argument("--hidden-size", type=int, default=64, help="model width (default 64)")
    parser.add_argument("--num-layers", type=int, default=2,
                        help="transformer blocks (default 2)")
    parser.add_argument("--vocab-size", type=int, default=512,
                        help="tokenizer vocabulary size in tokens (default 512)")
    parser.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    parser.add_argument("--fault", choices=FAULT_KINDS, default=None,
                        help="build a fault into the model. 'raise': every generation fails on "
                             "the server after exactly --fault-after-tokens generated tokens, "
                             "for any prompt and temperature (the next token is one that "
                             "mlx-lm's streaming detokenizer raises on)")
    parser.add_argument("--fault-after-tokens", type=int, default=None, metavar="N",
                        help="tokens generated normally before the fault fires, 0 to "
                             f"{MAX_FAULT_AFTER_TOKENS} (needs --fault; default 0)")
    parser.add_argument("--embedding", action="store_true",
                        help="write an embedding model (qwen3 architecture, last-token pooling "
                             "and L2 normalisation as Qwen3-Embedding; deploy it with "
                             "spec.model.task: TextEmbedding)")
    parser.add_argument("--force", action="store_true",
                        help="regenerate even if DIR already holds this model")


def run(args: argparse.Namespace) -> int:
    """Run the command for parsed ``args``; prints the model path; returns the exit code."""
    fault_kind = getattr(args, "fault", None)
    after = getattr(args, "fault_after_tokens", None)
    try:
        if fault_kind is None and after is not None:
            raise ValueError("--fault-after-tokens needs --fault")
        fault = None if fault_kind is None else Fault(fault_kind, 0 if after is None else after)
        path = make_test_model(Path(args.dir), hidden_size=args.hidden_size,
                               num_layers=args.num_layers, vocab_size=args.vocab_size,
                               seed=args.seed, force=args.force, fault=fault,
                               embedding=getattr(args, "embedding", False))
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
