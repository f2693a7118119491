"""Architectures no issue names: tiny ``transformers`` models of 30 architectures, each
recorded for real, solved at 50% and 30% of its peak (``auto``, 20 s) and replayed
(``python -m benchmarks.bench_zoo [ARCH ...] [--json PATH]``; ``make bench`` runs it).

A standing check of the general mechanism on models, graphs and loops that no test names:
per plan, the measured peak against the predicted one (to the byte where the mechanism
promises it) and the gradients against the unplanned run's; a few architectures also with
two micro-batches under bf16 autocast. A budget under the step's floor is reported with
the solver's own sentence, as a user would see it. Each builder is an ``--entry`` workload
(``taichi-plan record --entry benchmarks.bench_zoo:gpt_neox``), sized so that activations,
not parameters and AdamW state, hold most of the peak. Three zoo finds are regression
tests now (tests/test_rebuild_points.py: Funnel's trigger; tests/test_checkpoint_whole.py:
XLNet's re-run peak; tests/test_loops.py: XLNet's second micro-batch).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers as T

V, H, L, NH, S, B = 512, 64, 2, 4, 128, 16

def _workload(cls, cfg, data):
    """A zoo workload: ``cls(cfg)`` built from seed 0, then ``data()`` (its draws after the
    model's), the model's own loss, AdamW."""
    torch.manual_seed(0)
    model = cls(cfg)
    return model, data(), (lambda out, b: out.loss), torch.optim.AdamW(model.parameters(), lr=1e-3)

def _lm(cfg, cls, batch=B, seq=S, **extra):
    def data():
        ids = torch.randint(0, V, (batch, seq))
        return {"input_ids": ids, "labels": ids.clone(), **extra}
    return _workload(cls, cfg, data)

def _cls_img(cfg, cls, size=32, batch=B, ch=3):
    return _workload(cls, cfg, lambda: {"pixel_values": torch.randn(batch, ch, size, size),
                                        "labels": torch.randint(0, 10, (batch,))})

dec = dict(vocab_size=V, hidden_size=H, num_hidden_layers=L, num_attention_heads=NH, intermediate_size=4 * H,
           max_position_embeddings=128)

def gpt_neox(**_): return _lm(T.GPTNeoXConfig(**dec, hidden_dropout=0.1, attention_dropout=0.1), T.GPTNeoXForCausalLM)
def mistral(**_): return _lm(T.MistralConfig(**dec, num_key_value_heads=2), T.MistralForCausalLM)
def qwen2(**_): return _lm(T.Qwen2Config(**dec, num_key_value_heads=2, attention_dropout=0.1), T.Qwen2ForCausalLM)
def phi(**_): return _lm(T.PhiConfig(**dec, resid_pdrop=0.1, embd_pdrop=0.1), T.PhiForCausalLM)
def gemma(**_): return _lm(T.GemmaConfig(**dec, num_key_value_heads=2, head_dim=16), T.GemmaForCausalLM)
def falcon(**_): return _lm(T.FalconConfig(vocab_size=V, hidden_size=H, num_hidden_layers=L, num_attention_heads=NH,
                                            hidden_dropout=0.1, attention_dropout=0.1), T.FalconForCausalLM)
def bloom(**_): return _lm(T.BloomConfig(vocab_size=V, hidden_size=H, n_layer=L, n_head=NH, hidden_dropout=0.1,
                                          attention_dropout=0.1), T.BloomForCausalLM)
def gpt_bigcode(**_): return _lm(T.GPTBigCodeConfig(vocab_size=V, n_embd=H, n_layer=L, n_head=NH, n_positions=128),
                                 T.GPTBigCodeForCausalLM)
def codegen(**_): return _lm(T.CodeGenConfig(vocab_size=V, n_embd=H, n_layer=L, n_head=NH, n_positions=128,
                                              rotary_dim=8), T.CodeGenForCausalLM)
def opt(**_): return _lm(T.OPTConfig(vocab_size=V, hidden_size=H, num_hidden_layers=L, num_attention_heads=NH,
                                      ffn_dim=4 * H, max_position_embeddings=128, word_embed_proj_dim=H), T.OPTForCausalLM)
enc = dict(vocab_size=V, hidden_size=H, num_hidden_layers=L, num_attention_heads=NH, intermediate_size=4 * H,
           max_position_embeddings=256)
def roberta(**_): return _lm(T.RobertaConfig(**enc), T.RobertaForMaskedLM)
def electra(**_): return _lm(T.ElectraConfig(**enc, embedding_size=H), T.ElectraForMaskedLM)
def albert(**_): return _lm(T.AlbertConfig(**enc, embedding_size=32), T.AlbertForMaskedLM)
def distilbert(**_): return _lm(T.DistilBertConfig(vocab_size=V, dim=H, n_layers=L, n_heads=NH, hidden_dim=4 * H,
                                                   max_position_embeddings=128), T.DistilBertForMaskedLM)
def deberta_v2(**_): return _lm(T.DebertaV2Config(**enc), T.DebertaV2ForMaskedLM)
def mobilebert(**_): return _lm(T.MobileBertConfig(vocab_size=V, hidden_size=H, num_hidden_layers=L, num_attention_heads=NH,
                                                   intermediate_size=H, embedding_size=32, intra_bottleneck_size=32,
                                                   true_hidden_size=32, max_position_embeddings=128),
                                T.MobileBertForMaskedLM)
def t5(**_):
    cfg = T.T5Config(vocab_size=V, d_model=H, d_kv=16, d_ff=4 * H, num_layers=L, num_heads=NH, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    return _workload(T.T5ForConditionalGeneration, cfg, lambda: {"input_ids": torch.randint(0, V, (B, S)),
                                                                 "labels": torch.randint(0, V, (B, S // 2))})
def bart(**_):
    cfg = T.BartConfig(vocab_size=V, d_model=H, encoder_layers=L, decoder_layers=L, encoder_attention_heads=NH,
                       decoder_attention_heads=NH, encoder_ffn_dim=4 * H, decoder_ffn_dim=4 * H, max_position_embeddings=128)
    return _workload(T.BartForConditionalGeneration, cfg, lambda: {"input_ids": torch.randint(3, V, (B, S)),
                                                                   "labels": torch.randint(3, V, (B, S // 2))})
def convnext(**_): return _cls_img(T.ConvNextConfig(num_channels=3, hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 2, 1],
                                                    num_labels=10), T.ConvNextForImageClassification)
def mobilenet_v2(**_): return _cls_img(T.MobileNetV2Config(num_labels=10, image_size=32, depth_multiplier=0.35),
                                       T.MobileNetV2ForImageClassification)
def regnet(**_): return _cls_img(T.RegNetConfig(num_labels=10, hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 2, 1],
                                                embedding_size=16, groups_width=8), T.RegNetForImageClassification)
def deit(**_): return _cls_img(T.DeiTConfig(hidden_size=H, num_hidden_layers=L, num_attention_heads=NH,
                                            intermediate_size=4 * H, image_size=32, patch_size=4, num_labels=10,
                                            hidden_dropout_prob=0.1), T.DeiTForImageClassification)
def beit(**_): return _cls_img(T.BeitConfig(hidden_size=H, num_hidden_layers=L, num_attention_heads=NH,
                                            intermediate_size=4 * H, image_size=32, patch_size=4, num_labels=10,
                                            drop_path_rate=0.1, use_relative_position_bias=True), T.BeitForImageClassification)
def segformer(**_):
    cfg = T.SegformerConfig(num_labels=5, hidden_sizes=[16, 32, 48, 64], depths=[1, 1, 1, 1], decoder_hidden_size=32,
                            num_attention_heads=[1, 2, 2, 4], drop_path_rate=0.1)
    return _workload(T.SegformerForSemanticSegmentation, cfg, lambda: {"pixel_values": torch.randn(B, 3, 64, 64),
                                                                       "labels": torch.randint(0, 5, (B, 64, 64))})
def wav2vec2(**_):
    cfg = T.Wav2Vec2Config(vocab_size=32, hidden_size=H, num_hidden_layers=L, num_attention_heads=NH,
                           intermediate_size=4 * H, conv_dim=(32, 32), conv_stride=(5, 2), conv_kernel=(10, 3),
                           num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4, layerdrop=0.0,
                           mask_time_prob=0.0)
    return _workload(T.Wav2Vec2ForCTC, cfg, lambda: {"input_values": torch.randn(4, 4000),
                                                     "labels": torch.randint(1, 32, (4, 10))})
def whisper(**_):
    cfg = T.WhisperConfig(vocab_size=V, d_model=H, encoder_layers=L, decoder_layers=L, encoder_attention_heads=NH,
                          decoder_attention_heads=NH, encoder_ffn_dim=4 * H, decoder_ffn_dim=4 * H, num_mel_bins=16,
                          max_source_positions=50, max_target_positions=64,
                          pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)
    return _workload(T.WhisperForConditionalGeneration, cfg, lambda: {"input_features": torch.randn(B, 16, 100),
                                                                      "labels": torch.randint(0, V, (B, 16))})
def mixtral(**_): return _lm(T.MixtralConfig(**dec, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2),
                             T.MixtralForCausalLM)
def mamba(**_): return _lm(T.MambaConfig(vocab_size=V, hidden_size=H, num_hidden_layers=L, state_size=8), T.MambaForCausalLM)
def xlnet(**_): return _lm(T.XLNetConfig(vocab_size=V, d_model=H, n_layer=L, n_head=NH, d_inner=4 * H), T.XLNetLMHeadModel)
def funnel(**_): return _lm(T.FunnelConfig(vocab_size=V, d_model=H, n_head=NH, d_head=16, d_inner=4 * H,
                                            block_sizes=[1, 1], num_decoder_layers=1), T.FunnelForMaskedLM)

# the builders above, in order (defined before anything else of this module's own)
ARCHS = [n for n, f in list(globals().items()) if callable(f) and getattr(f, "__module__", None) == __name__
         and not n.startswith("_")]
FRACTIONS = (0.5, 0.3)
LOOPED = ("gpt_neox", "qwen2", "t5", "bart", "funnel", "xlnet")  # also 2 micro-batches under bf16 autocast
TIME_LIMIT = 20.0


def _loop_name(loop) -> str:
    return "2 micro-batches, bf16 autocast" if loop else "plain"


def one(arch: str, fraction: float, d: Path, loop=None) -> dict:
    """Record ``arch`` (with ``loop``), solve at ``fraction`` of its peak, replay the plan."""
    from taichi_plan.base.errors import InfeasibleBudgetError
    from taichi_plan.plan.format import save_plan
    from taichi_plan.record import get_workload, record_workload
    from taichi_plan.replay.measure import replay
    from taichi_plan.solve import solve
    from taichi_plan.trace.format import baseline_peak, read_trace, write_trace

    tag = f"{arch}{'-accum-bf16' if loop else ''}"
    tdir = d / tag
    if not (tdir / "meta.json").exists():
        write_trace(record_workload(get_workload(entry=f"benchmarks.bench_zoo:{arch}"), fake=False, loop=loop,
                                    calibrate=False), tdir, force=True)
    trace = read_trace(tdir)
    peak = int(baseline_peak(trace)[0])
    row = {"arch": arch, "loop": _loop_name(loop), "fraction": fraction,
           "ops": trace.num_ops, "peak_bytes": peak}
    t0 = time.perf_counter()
    try:
        plan = solve(trace, int(peak * fraction), "auto", time_limit=TIME_LIMIT, seed=0)
    except InfeasibleBudgetError as e:
        row.update(feasible=False, floor_bytes=e.min_budget_bytes, solve_s=time.perf_counter() - t0)
        return row
    row.update(feasible=True, solve_s=time.perf_counter() - t0, drops=len(plan.recompute),
               partitions=[f"{q.module} {q.over} x{q.chunks}" for q in plan.partitions])
    path = save_plan(plan, d / f"{tag}-{int(fraction * 100)}.plan.json", force=True)
    r = replay(path, steps=1)
    row.update(budget_bytes=r["budget_bytes"], predicted_bytes=r["predicted_peak_bytes"],
               measured_bytes=r["measured_peak_bytes"], within_budget=r["within_budget"],
               grads_match=r.get("grads_match"), grads_check=_check_kind(r.get("grads_check") or ""))
    return row


def _check_kind(check: str) -> str:
    """Replay's gradient check in a word: ``bitwise``, ``allclose`` (chunks sum in another
    order), or ``parameters`` (the optimizer stepped in backward frees the gradients)."""
    for kind in ("bitwise", "allclose"):
        if check.startswith(kind):
            return kind
    return "parameters" if check.startswith("parameters") else check


def run(archs=None, fractions=FRACTIONS, looped=LOOPED, progress=lambda msg: None) -> dict:
    """Every architecture at each fraction, then the looped ones at the first; one thread."""
    from taichi_plan.torch_common.loop import Loop

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    rows = []
    try:
        with tempfile.TemporaryDirectory(prefix="bench-zoo-") as tmp:
            d = Path(tmp)
            jobs = [(a, f, None) for a in (archs or ARCHS) for f in fractions]
            jobs += [(a, fractions[0], Loop(micro_batches=2, autocast="bf16")) for a in looped if a in (archs or ARCHS)]
            for a, f, loop in jobs:
                progress(f"zoo: {a} at {f:.0%}{' (2 micro-batches, bf16)' if loop else ''}")
                try:
                    rows.append(one(a, f, d, loop))
                except Exception as e:  # noqa: BLE001  (one architecture failing must not lose the others)
                    rows.append({"arch": a, "loop": _loop_name(loop),
                                 "fraction": f, "error": f"{type(e).__name__}: {str(e)[:300]}"})
    finally:
        torch.set_num_threads(old)
    return {"torch": torch.__version__, "transformers": T.__version__, "rows": rows,
            "seconds": time.perf_counter() - t0}


def _mb(n) -> str:
    return f"{n / 1e6:.2f}"


def markdown(result: dict) -> str:
    rows = result["rows"]
    out = ["| architecture | loop | budget | ops | peak MB | plan | predicted MB | measured MB | measured - predicted B "
           "| gradients |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        head = f"| {r['arch']} | {r['loop']} | {r['fraction']:.0%} |"
        if "error" in r:
            out.append(f"{head} | | **error**: {r['error']} | | | | |")
        elif not r["feasible"]:
            out.append(f"{head} {r['ops']} | {_mb(r['peak_bytes'])} | none: floor {_mb(r['floor_bytes'])} MB "
                       f"({r['floor_bytes'] / r['peak_bytes']:.2f}) | | | | |")
        else:
            diff = r["measured_bytes"] - r["predicted_bytes"]
            plan = f"{r['drops']} drops" + (f", {', '.join(r['partitions'])}" if r["partitions"] else "")
            over = "" if r["within_budget"] else " **over budget**"
            out.append(f"{head} {r['ops']} | {_mb(r['peak_bytes'])} | {plan} | {_mb(r['predicted_bytes'])} | "
                       f"{_mb(r['measured_bytes'])} | {diff:+,}{over} | "
                       f"{'match, ' if r['grads_match'] else '**differ**, '}{r['grads_check']} |")
    plans = [r for r in rows if r.get("feasible")]
    exact = sum(r["measured_bytes"] == r["predicted_bytes"] for r in plans)
    over = sum(not r["within_budget"] for r in plans)
    bad = sum(not r["grads_match"] for r in plans)
    errors = sum("error" in r for r in rows)
    out.append(f"\nTally: {len(rows)} runs, {len(plans)} plans replayed: measured == predicted to the byte on "
               f"{exact}, over budget on {over}, gradients differing on {bad}; {errors} errors. "
               f"torch {result['torch']}, transformers {result['transformers']}; {result['seconds']:.0f} s.")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("archs", nargs="*", help=f"some of: {', '.join(ARCHS)}")
    ap.add_argument("--json", help="also write the raw rows here")
    args = ap.parse_args()
    unknown = [a for a in args.archs if a not in ARCHS]
    if unknown:
        sys.exit(f"Unknown architecture(s) {', '.join(unknown)}; choose from {', '.join(ARCHS)}.")
    result = run(args.archs or None, progress=lambda msg: print(msg, file=sys.stderr, flush=True))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    print(markdown(result))


if __name__ == "__main__":
    main()
