"""The embedded default models: built offline in seconds, cached, loaded like any checkpoint.

No model hub is reachable on the project's machines, so ``build_tiny_model`` writes a small
model folder itself: a byte-level BPE tokenizer trained with ``tokenizers`` on text sampled from
the tasks that ship with freshper (random replies; a plugin's task adds its own, :func:`task_model`), with Qwen-style chat and vision special tokens and a
Qwen-style chat template, plus a randomly initialised Qwen2 (text) or Qwen2-VL (vision) model.
The folder is written with ``save_pretrained`` and is loaded through the same
``Policy.from_pretrained`` path a real Qwen2.5 / Qwen2.5-VL checkpoint takes.

The cache key hashes the training text and the configuration, so a change to a task's wording
rebuilds the tokenizer instead of silently reusing a stale one.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import random
import shutil
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

TINY_FORMAT_VERSION = 2  # 2: role lines in the tokenizer corpus
#: Chat and vision special tokens, in id order right after the 256 byte tokens.
SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
#: Reply tags kept as single (non-special: they decode as text) tokens.
TAG_TOKENS = ["<answer>", "</answer>", "<search>", "</search>", "<think>", "</think>", "<information>", "</information>"]

#: Qwen2-VL-style template. Unlike Qwen's, it adds no default system message (shorter prompts).
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_FALLBACK_TEXT = """\
<answer>Up</answer> <answer>Down</answer> <answer>Left</answer> <answer>Right</answer>
<search>query</search> <information>passage</information> <think>thinking</think>
Invalid reply: no <answer>...</answer> tag found. Turns left: 0 1 2 3 4 5 6 7 8 9.
The episode is over. You reached the goal. You fell into a hole. Reply with one move.
"""


#: Role lines of CHAT_TEMPLATE (``<|im_start|>{role}\n``) as they precede each message's text.
_USER, _ASSISTANT = "user\n", "assistant\n"


class cache_lock:
    """An exclusive ``flock`` on ``path`` while a cached model folder is built, so processes
    started together build it once and never replace a folder another one is loading."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)

    def __enter__(self) -> None:
        import fcntl

        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = self.path.open("a")
        fcntl.flock(self._fh, fcntl.LOCK_EX)

    def __exit__(self, *exc) -> None:
        import fcntl

        fcntl.flock(self._fh, fcntl.LOCK_UN)
        self._fh.close()


@contextlib.contextmanager
def staged_folder(root: Path, prefix: str, target: Path):
    """A temporary folder under ``root`` to build a cached folder in; on success it replaces
    ``target`` in one rename (a crash never leaves a half-written ``target``), on failure it goes."""
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=prefix))
    try:
        yield tmp
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def default_cache_dir() -> Path:
    """``$FRESHPER_CACHE`` or ``.cache/freshper`` under the current directory."""
    return Path(os.environ.get("FRESHPER_CACHE") or Path.cwd() / ".cache" / "freshper")


def task_corpus(episodes_per_task: int = 12, seed: int = 0) -> str:
    """Text of sampled episodes of every task that ships with freshper
    (:data:`envs._builtin.BUILTIN_IDS`) and builds without optional packages or required
    keyword arguments, random replies, each message preceded by its chat-template role line
    (``user`` / ``assistant``), as the model sees it: so the BPE learns the role names as single
    tokens (they were 3 and 7 tokens, in every prompt).

    Plugins and tasks registered at run time are left out, so the shared tokenizer, and with it
    the default model and its cache key, is the same whatever else is installed; such a task
    gets a tokenizer of its own (:func:`task_model`). A built-in task that fails to build or run
    is skipped with a warning: the tokenizer must build even while a task is broken.
    """
    import envs  # noqa: F401  (registers tasks)
    from envs._builtin import BUILTIN_IDS
    from envs.registry import registered_tasks

    rng = random.Random(seed)
    parts = [_FALLBACK_TEXT]
    for spec in registered_tasks():
        # tasks of optional packages, or that need a kwarg (a server's url): not part of the default model
        if spec.id not in BUILTIN_IDS or spec.requires or spec.needs:
            continue
        parts.extend(task_episodes(spec.id, rng, episodes_per_task=episodes_per_task, seed=seed))
    return "\n".join(parts)


def task_episodes(env_id: str, rng: random.Random, env_kwargs: dict | None = None, *, episodes_per_task: int = 12,
                  seed: int = 0) -> list[str]:
    """The messages of ``episodes_per_task`` episodes of ``env_id`` played with random replies
    drawn from ``rng`` (each preceded by its role line). A task that cannot be built or fails
    while it is played gives what was played before the failure, with a warning that says why."""
    with _quiet_tasks():
        return _task_episodes(env_id, rng, env_kwargs, episodes_per_task, seed)


@contextlib.contextmanager
def _quiet_tasks():
    """The tasks' own INFO lines (SearchQA building its knowledge base and index) held back while
    their episodes are sampled for a tokenizer: they would read as if the run used those tasks."""
    loggers = [logging.getLogger(name) for name in ("envs", "bm25s")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.WARNING)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _task_episodes(env_id: str, rng: random.Random, env_kwargs: dict | None, episodes_per_task: int,
                   seed: int) -> list[str]:
    from envs.registry import make

    try:
        env = make(env_id, **dict(env_kwargs or {}))
    except Exception as exc:  # a task under construction must not break the build
        logger.warning("tiny tokenizer: %s is left out of the tokenizer's text: it cannot be built (%s)", env_id, exc)
        return []
    parts: list[str] = []
    try:
        for ep in range(episodes_per_task):
            obs, info = env.reset(seed=seed * 100_003 + ep)
            parts.append(_USER + obs["text"])
            for _ in range(10):
                reply = _random_reply(env, rng)
                parts.append(_ASSISTANT + reply)
                obs, _, term, trunc, info = env.step(reply)
                parts.append(_USER + obs["text"])
                if term or trunc:
                    break
    except Exception as exc:
        logger.warning("tiny tokenizer: %s failed while its episodes were sampled for the tokenizer's text, which "
                       "has only what came before (%s: %s)", env_id, type(exc).__name__, exc)
    finally:
        env.close()
    return parts


def _random_reply(env, rng: random.Random) -> str:
    task = env.unwrapped
    legal = []
    try:
        legal = list(task.legal_actions())
    except Exception:  # a task that draws its replies with sample_reply
        pass
    if legal and rng.random() < 0.85:
        return task.format_reply(rng.choice(legal))
    return rng.choice(["<answer>Up</answer>", "Down", "<answer>jump</answer>", "I think so."])


def _train_tokenizer(corpus: str, vocab_size: int):
    """A byte-level BPE with the special tokens first (fixed ids) and reply tags as single tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus.split("\n"), trainer=trainer)
    tok.add_tokens(TAG_TOKENS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


#: Hidden size of the embedded tiny models' decoder. ``width`` makes a wider one: heads of 32
#: (so the vision model's rotary sections still fit), two query heads per key-value head, an
#: MLP of three times the width, the same four layers.
DEFAULT_WIDTH = 128


def check_width(width: int) -> int:
    if not isinstance(width, int) or width < 64 or width % 64:
        raise ValueError(f"the tiny model's width must be a multiple of 64 (heads of 32, two per key-value head), got {width!r}")
    return width


def _decoder_dims(tokenizer, width: int = DEFAULT_WIDTH) -> dict:
    """The language decoder shared by the tiny text and vision models (~0.8M parameters at the
    default width of 128; ~3.4M at 256)."""
    return dict(
        vocab_size=len(tokenizer),
        hidden_size=width,
        intermediate_size=3 * width,
        num_hidden_layers=4,
        num_attention_heads=width // 32,
        num_key_value_heads=width // 64,
        max_position_embeddings=4096,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def _text_model(tokenizer, seed: int, width: int = DEFAULT_WIDTH):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(**_decoder_dims(tokenizer, width), tie_word_embeddings=True)
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(cfg)


def _vision_model(tokenizer, seed: int, width: int = DEFAULT_WIDTH):
    import torch
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    ids = tokenizer.convert_tokens_to_ids
    cfg = Qwen2VLConfig(
        text_config=dict(
            **_decoder_dims(tokenizer, width),
            rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [4, 6, 6]},
        ),
        vision_config=dict(
            # hidden_size: the width the merger projects the visual tokens into (the decoder's)
            depth=2, embed_dim=96, hidden_size=width, num_heads=4, mlp_ratio=2,
            patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
        ),
        freshper_positions="flat",  # 1-D rotary positions (agents.policies.policy.FLAT_POSITIONS)
        image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"),
        vision_end_token_id=ids("<|vision_end|>"),
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    return Qwen2VLForConditionalGeneration(cfg)


def _vision_processor(tokenizer):
    from transformers import Qwen2VLImageProcessor, Qwen2VLProcessor

    image_processor = Qwen2VLImageProcessor(
        min_pixels=56 * 56, max_pixels=28 * 28 * 256, patch_size=14, merge_size=2, temporal_patch_size=2
    )
    try:
        from transformers import Qwen2VLVideoProcessor

        video_processor = Qwen2VLVideoProcessor(patch_size=14, merge_size=2, temporal_patch_size=2)
    except Exception:  # older transformers: no video processor class
        video_processor = None
    return Qwen2VLProcessor(
        image_processor=image_processor, tokenizer=tokenizer, video_processor=video_processor,
        chat_template=CHAT_TEMPLATE,
    )


def build_tiny_model(
    modality: str = "text",
    cache_dir: str | os.PathLike | None = None,
    seed: int = 0,
    *,
    vocab_size: int = 512,
    force: bool = False,
    task_text: str = "",
    width: int = DEFAULT_WIDTH,
) -> Path:
    """Build (once) and return the folder of the embedded tiny model for ``modality``.

    ``"text"``: Qwen2, hidden 128, 4 layers, tied embeddings (~1M parameters); ``width``: a
    wider decoder (:data:`DEFAULT_WIDTH`), in a folder of its own (``tiny-text-s0-w256-...``).
    ``"vision"``: Qwen2-VL with the same text stack and a 2-layer vision tower (patch 14,
    spatial merge 2, so one 28x28 tile is one visual token) plus a Qwen2-VL processor; its
    decoder takes 1-D rotary positions (``freshper_positions: flat``, agents/policies/policy.py).
    The folder is written to a temporary name and renamed, so a crash never leaves a
    half-written model; a folder missing its completion marker is rebuilt.
    """
    name, corpus = _name_and_corpus(modality, seed, vocab_size, task_text, width)
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = root / name
    key = name.rsplit("-", 1)[-1]
    marker = target / "freshper_tiny.json"
    if target.exists() and marker.exists() and not force:
        return target
    with cache_lock(root / f".{target.name}.lock"):
        if target.exists() and marker.exists() and not force:
            return target  # built by another process meanwhile
        return _build(target, modality, corpus, key, seed, vocab_size, root, width)


def tiny_model_name(modality: str = "text", seed: int = 0, *, vocab_size: int = 512, task_text: str = "",
                    width: int = DEFAULT_WIDTH) -> str:
    """The cache folder name :func:`build_tiny_model` gives these arguments (``tiny-text-s0-<key>``),
    without building anything: the key hashes the tokenizer's text and the configuration."""
    return _name_and_corpus(modality, seed, vocab_size, task_text, width)[0]


def _name_and_corpus(modality: str, seed: int, vocab_size: int, task_text: str, width: int) -> tuple[str, str]:
    if modality not in ("text", "vision"):
        raise ValueError(f"modality must be 'text' or 'vision', got {modality!r}")
    check_width(width)
    corpus = task_corpus(seed=0)
    key = hashlib.sha256(
        json.dumps([TINY_FORMAT_VERSION, modality, seed, vocab_size, CHAT_TEMPLATE, corpus]
                   + (["flat positions"] if modality == "vision" else [])
                   + ([hashlib.sha256(task_text.encode()).hexdigest()] if task_text else [])
                   + ([f"width {width}"] if width != DEFAULT_WIDTH else [])).encode()
    ).hexdigest()[:12]
    if task_text:  # a task's own text (its episodes, its TaskVocabulary) beside the built-in tasks' episodes
        corpus = f"{corpus}\n{task_text}"
    return f"tiny-{modality}-s{seed}{f'-w{width}' if width != DEFAULT_WIDTH else ''}-{key}", corpus


#: Vocabulary of a tiny model whose task brings its own text (``tokenizer_text``): room for
#: its names as whole tokens. The shared tokenizer keeps 512.
TASK_VOCAB_SIZE = 2048


def task_model(env_id: str, env_kwargs: dict | None = None, cache_dir: str | os.PathLike | None = None,
               seed: int = 0, width: int = DEFAULT_WIDTH) -> Path:
    """The embedded tiny model for ``env_id``: the shared one of its modality for a task that
    ships with freshper; a tokenizer of its own for a plugin's task or one registered at run time
    (the built-in tasks' text plus episodes of this task, so installing it moves no other task's
    model); and where the task has text of its own (:class:`envs.capabilities.TaskVocabulary`), a
    tokenizer (``TASK_VOCAB_SIZE`` tokens) that also learned from that text."""
    modality, kwargs = task_model_args(env_id, env_kwargs)
    return build_tiny_model(modality, cache_dir=cache_dir, seed=seed, width=width, **kwargs)


def task_model_name(env_id: str, env_kwargs: dict | None = None, seed: int = 0, width: int = DEFAULT_WIDTH) -> str:
    """The cache folder name of :func:`task_model`'s model, without building it."""
    modality, kwargs = task_model_args(env_id, env_kwargs)
    return tiny_model_name(modality, seed, width=width, **kwargs)


def task_model_args(env_id: str, env_kwargs: dict | None = None) -> tuple[str, dict]:
    """The modality of ``env_id`` and the tokenizer arguments of its tiny model
    (``vocab_size``, ``task_text``; none for a built-in task without text of its own)."""
    import envs
    from envs._builtin import BUILTIN_IDS
    from envs.capabilities import tokenizer_text

    env = envs.make(env_id, **dict(env_kwargs or {}))
    try:
        text = tokenizer_text(env.unwrapped)
    finally:
        env.close()
    modality = envs.task_spec(env_id).modality
    parts = [] if env_id in BUILTIN_IDS else ["\n".join(task_episodes(env_id, random.Random(0), env_kwargs))]
    if text:
        parts.append(text)
    kwargs = {"task_text": "\n".join(parts)} if parts else {}
    if text:
        kwargs["vocab_size"] = TASK_VOCAB_SIZE
    return modality, kwargs


def _build(target: Path, modality: str, corpus: str, key: str, seed: int, vocab_size: int, root: Path,
           width: int = DEFAULT_WIDTH) -> Path:
    with staged_folder(root, f".tiny-{modality}-", target) as tmp:
        tokenizer = _train_tokenizer(corpus, vocab_size)
        if modality == "text":
            model = _text_model(tokenizer, seed, width)
            tokenizer.save_pretrained(tmp)
        else:
            model = _vision_model(tokenizer, seed, width)
            _vision_processor(tokenizer).save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
        model.generation_config.do_sample = True
        model.generation_config.top_k = None
        model.generation_config.top_p = None
        model.save_pretrained(tmp)
        n_params = sum(p.numel() for p in model.parameters())
        (tmp / "freshper_tiny.json").write_text(
            json.dumps({"modality": modality, "seed": seed, "key": key, "parameters": n_params, "width": width,
                        "vocab_size": len(tokenizer)})
        )
    logger.info("built tiny %s model (%d parameters) at %s", modality, n_params, target)
    return target
