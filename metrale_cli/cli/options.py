"""The options the commands share, declared once.

decode, verify and forward take the same options around their own: the model and the prompt before them
(_pass_head), the device, the format, the dumps, the timings, the context and tensor parallelism after
(_pass_tail). Such a command declares only its own options and takes the shared ones as one Common: the
decorator pass_options gives typer the whole signature, in that order, so the help lists the options as
each command always did. score, compare and bench take a few of the same options by their aliases.
"""


import functools
import inspect
from dataclasses import dataclass
from typing import Annotated, Any, Callable, Optional

import typer

from ..inputs import PromptFormat
from ..model import EMBEDDED_MODELS

EMBEDDED_HELP = f"an embedded model by name: {', '.join(EMBEDDED_MODELS)} (an existing path of that name wins)"

DEFAULT_K = 4

ModelOpt = Annotated[Optional[str], typer.Option(
    "--model", "-m", metavar="PATH",
    help=f"Checkpoint directory, .safetensors file or index.json, or {EMBEDDED_HELP}. Default: default.")]
PromptOpt = Annotated[Optional[str], typer.Option(
    "--prompt", "-p", metavar="TEXT", help="Prompt text (needs tokenizer.json). Default: \"The for statement\".")]
TokensOpt = Annotated[Optional[str], typer.Option(
    "--tokens", "-t", metavar="IDS",
    help="Prompt token ids: \"1 2 3\", \"1,2,3\" or a JSON array \"[1, 2, 3]\"; '-' reads them from stdin.")]
ChatOpt = Annotated[bool, typer.Option(
    "--chat", help="Format --prompt with the checkpoint's chat template (as transformers' apply_chat_template).")]
SystemOpt = Annotated[Optional[str], typer.Option(
    "--system", metavar="TEXT", help="With --chat: a system message before the prompt.")]
NoSpecialTokensOpt = Annotated[bool, typer.Option(
    "--no-special-tokens", help="Encode --prompt without the tokenizer's added BOS/template tokens.")]
TextFileOpt = Annotated[Optional[str], typer.Option(
    "--text-file", metavar="F", help="The text of file F as the prompt (UTF-8; '-' reads stdin).")]
DeviceOpt = Annotated[str, typer.Option("--device", metavar="auto|cpu|cuda", help="Where to run.")]
LogitsDtypeOpt = Annotated[Optional[str], typer.Option(
    "--logits-dtype", metavar="bf16|fp32",
    help="Dtype of the logits rows the engine writes. Default: fp32 on the CPU (the NumPy engine's own rows: "
         "its greedy tokens are transformers' fp32 greedy tokens), bf16 on the GPU (the CUDA engine's rows). "
         "A bf16 row whose maximum is a tie (the lowest id wins) or, on the CPU, whose argmax differs from "
         "the fp32 logits' is marked in the report.", show_default=False)]
ComputeOpt = Annotated[Optional[str], typer.Option(
    "--compute", metavar="fp32|bf16",
    help="The CPU engine's precision: fp32 (default, the reference) or bf16 (weights, activations and KV cache "
         "rounded to bf16 where transformers' bf16 forward rounds them, to check a bf16 engine like with like). "
         "--device cuda computes in bf16 (its weights are bf16) and refuses fp32.")]
MlaOpt = Annotated[Optional[str], typer.Option(
    "--mla", metavar="naive|absorbed",
    help="The CPU engine's algebra for latent-attention (DeepSeek MLA) layers: naive (default, as transformers: "
         "every cached latent decompressed into per-head keys and values) or absorbed (kv_b_proj folded into the "
         "query and the output, attention over the cached latents, as inference engines compute it). Both read "
         "the same latent cache; other layers ignore it. --device cuda decodes in the absorbed form (its default: "
         "naive long prefills; absorbed: absorbed throughout; naive is refused there).")]
ActivationQuantOpt = Annotated[Optional[str], typer.Option(
    "--activation-quant", metavar="none|emulate",
    help="A quantized checkpoint's activations: none (default: fp32 on the CPU engine, the ideal reference of the "
         "stored weights) or emulate (each quantized weight's input quantized as the checkpoint's scheme says an "
         "engine does, e.g. FP8 W8A8's dynamic e4m3 scales per token and 128 columns), so a difference splits "
         "into activation quantization and the rest. The CUDA engine emulates FP8 weights' schemes. Recorded in "
         "every dump's metadata.")]
ThreadsOpt = Annotated[Optional[int], typer.Option(
    "--threads", metavar="N",
    help="Threads of the CPU engine's projections (default: the cores available to metrale). "
         "The GPU engine ignores it.")]
FormatOpt = Annotated[Optional[str], typer.Option(
    "--format", "-f", metavar="rich|plain|json", help="Output format (default: rich on a terminal, else plain).")]
DumpLogitsOpt = Annotated[Optional[str], typer.Option(
    "--dump-logits", metavar="PATH",
    help="Write the command's logits rows (every dump holds the same rows: forward's --rows; decode's rows "
         "that chose each token; verify's prompt-last and verify rows): .safetensors (a typed BF16 or F32 tensor), .npy (bf16 rows as uint16 bit "
         "patterns, as .npy has no bf16: the .json sidecar says so and how to get float32), .bin, or - (stdout).")]
HiddenOpt = Annotated[bool, typer.Option(
    "--hidden", help="Summarize the hidden state after the final norm (of the last row).")]
DumpHiddenOpt = Annotated[Optional[str], typer.Option(
    "--dump-hidden", metavar="PATH",
    help="Write the hidden state after the final norm behind each of the command's rows (the rows "
         "--dump-logits holds), fp32 [rows, hidden]: .safetensors, .npy or .bin.")]
DumpLayersOpt = Annotated[Optional[str], typer.Option(
    "--dump-layers", metavar="PATH",
    help="Write every module's output (fp32 [rows, width], named after the Hugging Face modules) for the "
         "command's rows (the rows --dump-logits holds): .safetensors or .npz; .json with --dump-stats.")]
LayersOpt = Annotated[Optional[str], typer.Option(
    "--layers", metavar="I,J,...", help="The layers --dump-layers holds: indices, -1 = the last (default: all).")]
DumpStatsOpt = Annotated[bool, typer.Option(
    "--dump-stats", help="--dump-layers writes per-tensor statistics (min, max, mean, std, NaN/Inf counts, "
                         "sha256) as .json instead of the data, for models too big to dump whole.")]
TapsOpt = Annotated[Optional[str], typer.Option(
    "--taps", metavar="default|fine",
    help="What --dump-layers holds of each attention layer with a dense MLP: default (every module's output) or "
         "fine (also the values inside the block that other engines dump: input_layernorm, q/k/v after the "
         "projection, q/k norm, q/k after rope, o_proj's input, the MLP's input norm, gate and up, down_proj's "
         "input; the CPU engine).")]
DumpStateOpt = Annotated[Optional[str], typer.Option(
    "--dump-state", metavar="PATH",
    help="Write the recurrent and conv states of every linear-attention layer after the run (fp32 "
         "safetensors: model.layers.{i}.linear_attn.recurrent_state / .conv_state).")]
TimingsOpt = Annotated[bool, typer.Option("--timings", help="Report load, prefill and per-token times.")]
MaxContextOpt = Annotated[Optional[int], typer.Option(
    "--max-context", metavar="N",
    help="KV cache positions (default: just what the job needs). decode needs prompt + --steps - 1 (the last "
         "token produced is never fed back), verify prompt + --k, forward the prompt.")]
TpOpt = Annotated[Optional[int], typer.Option(
    "--tp", metavar="N",
    help="Tensor parallelism: the model sharded over N ranks, one process each (Megatron style). --device cuda: "
         "N GPUs of this host over NCCL; --device cpu: N NumPy engine processes summing through shared memory "
         "(checks the sharding; not faster). --tp 1 runs the same sharded path on one rank.")]
DraftModelOpt = Annotated[Optional[str], typer.Option(
    "--draft-model", metavar="PATH",
    help="A smaller checkpoint with the same tokenizer that drafts tokens (a path or an embedded name, "
         "e.g. default-draft).")]


@dataclass
class Common:
    """The options every pass command takes, as given."""

    model: str | None
    prompt: str | None
    tokens: str | None
    device: str
    logits_dtype: str | None  # None: the device's default (model.default_logits_dtype)
    fmt: str | None
    dump_logits: str | None
    hidden: bool
    dump_hidden: str | None
    timings: bool
    max_context: int | None
    chat: bool = False
    system: str | None = None
    no_special_tokens: bool = False
    compute: str | None = None  # --compute; None: the device's own (fp32 on the CPU, bf16 on the GPU)
    layers: "LayerOptions | None" = None
    tp: int | None = None  # --tp N: ranks of tensor parallelism (None: the plain one-process engine)
    mla: str | None = None  # --mla naive|absorbed; None: naive
    activation_quant: str | None = None  # --activation-quant none|emulate; None: none
    threads: int | None = None  # --threads N: the CPU engine's threads (None: the cores available)

    @property
    def prompt_format(self) -> PromptFormat:
        return PromptFormat(self.chat, self.system, not self.no_special_tokens)


@dataclass
class LayerOptions:
    """--dump-layers PATH, --layers I,J,... and --dump-stats, as given."""

    path: str | None
    select: str | None
    stats: bool
    taps: str | None = None  # --taps default|fine; None: default

    @property
    def wanted(self) -> bool:
        return self.path is not None


def _pass_head(model: ModelOpt = None, prompt: PromptOpt = None, tokens: TokensOpt = None, chat: ChatOpt = False,
               system: SystemOpt = None, no_special_tokens: NoSpecialTokensOpt = False) -> None:
    """The shared options before a pass command's own (only this signature is used)."""


def _pass_tail(device: DeviceOpt = "auto", logits_dtype: LogitsDtypeOpt = None, compute: ComputeOpt = None,
               mla: MlaOpt = None, activation_quant: ActivationQuantOpt = None, threads: ThreadsOpt = None,
               fmt: FormatOpt = None,
               dump_logits: DumpLogitsOpt = None, hidden: HiddenOpt = False, dump_hidden: DumpHiddenOpt = None,
               dump_layers: DumpLayersOpt = None, layers: LayersOpt = None, dump_stats: DumpStatsOpt = False,
               taps: TapsOpt = None,
               timings: TimingsOpt = False, max_context: MaxContextOpt = None, tp: TpOpt = None) -> None:
    """The shared options after a pass command's own (only this signature is used)."""


def pass_options(command: Callable[..., None]) -> Callable[..., None]:
    """`command(ctx, common, **own)` as the typer command `(ctx, *head, *own, *tail)`: typer reads the
    signature set here, and each call gathers the shared options into one Common."""
    head = list(inspect.signature(_pass_head).parameters.values())
    tail = list(inspect.signature(_pass_tail).parameters.values())
    ctx, _common, *own = inspect.signature(command).parameters.values()
    shared = [p.name for p in head + tail]

    @functools.wraps(command)
    def run(ctx: typer.Context, **options: Any) -> None:
        given = {name: options.pop(name) for name in shared}
        layers = LayerOptions(given.pop("dump_layers"), given.pop("layers"), given.pop("dump_stats"),
                              given.pop("taps"))
        command(ctx, Common(**given, layers=layers), **options)

    signature = inspect.Signature([ctx, *head, *own, *tail], return_annotation=None)
    run.__signature__ = signature  # type: ignore[attr-defined]
    run.__annotations__ = {p.name: p.annotation for p in signature.parameters.values()} | {"return": None}
    return run
