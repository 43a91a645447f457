// k3 data / k3 train: build a token shard from text files; train a model from a config on it.
#include <cstdio>
#include <memory>

#include "cli/commands.h"
#include "core/error.h"
#include "io/output_file.h"
#include "tokenizer/tokenizer.h"
#include "train/data.h"
#include "train/trainer.h"

namespace k3::cli {

void register_data(CLI::App& app) {
  struct Opts {
    std::string tokenizer, out;
    std::vector<std::string> files;
  };
  auto o = std::make_shared<Opts>();
  CLI::App* sub = app.add_subcommand(
      "data",
      "Tokenise text files into a training shard (uint32 ids, memory-mapped by `k3 train`). Each file is\n"
      "one document, followed by the end-of-document id <|end_of_msg|>; special-token text in the files is\n"
      "plain text. Writes OUT atomically.");
  sub->add_option("--tokenizer", o->tokenizer, "tokenizer directory (tiktoken.model [+ tokenizer_config.json])")
      ->required();
  sub->add_option("--out", o->out, "output shard file")->required();
  sub->add_option("files", o->files, "text files (one document each)")->required();
  sub->callback([o] {
    check_output_path(o->out);
    const Tokenizer tok = Tokenizer::load_dir(o->tokenizer);
    const uint32_t eod = uint32_t(tok.special_id(K3Special::kEndOfMsg));
    const std::vector<uint32_t> ids = train::tokenize_documents(tok, o->files, eod);
    train::write_token_shard(o->out, ids, eod);
    std::printf("%zu documents, %zu tokens (vocabulary %lld, end-of-document id %u) -> %s\n", o->files.size(),
                ids.size(), (long long)tok.vocab_size(), eod, o->out.c_str());
  });
}

void register_train(CLI::App& app) {
  auto o = std::make_shared<train::TrainOptions>();
  auto stages = std::make_shared<std::string>();
  auto balance = std::make_shared<std::string>("qb-exact");
  CLI::App* sub = app.add_subcommand(
      "train",
      "Train a K3 model from CONFIG on a token shard (see `k3 data`): in float64 on the CPU, or on one\n"
      "Hopper GPU (--device cuda) in bf16 mixed precision or fp32. Explicit forward/backward of every\n"
      "block, AdamW for vectors/embeddings/lm_head and Per-Head Muon for matrices, cosine schedule with\n"
      "linear warmup, gradient clipping, Quantile Balancing of the MoE routers. Curriculum stages\n"
      "SEQ_LEN:TOKENS run in order with constant tokens per step.\n"
      "Writes OUT/step-N/ checkpoints (config.json + model.safetensors, loadable by `k3 generate`, +\n"
      "train_state.bin), OUT/latest and OUT/metrics.jsonl; --resume continues from OUT/latest with\n"
      "identical losses. A NaN/Inf loss or gradient stops the run (or skips the step).");
  sub->add_option("--config", o->config_path, "model config.json")->required();
  sub->add_option("--data", o->data_path, "token shard (k3 data)")->required();
  sub->add_option("--out", o->out_dir, "run directory")->required();
  sub->add_option("--stages", *stages, "curriculum, e.g. 64:100000,256:50000 (default: one stage of length 256)");
  sub->add_option("--tokens", o->tokens, "total tokens when --stages is not given")->capture_default_str();
  sub->add_option("--tokens-per-step", o->tokens_per_step, "tokens per optimizer step")->capture_default_str();
  sub->add_option("--lr", o->lr, "peak learning rate")->capture_default_str();
  sub->add_option("--min-lr-ratio", o->min_lr_ratio, "final lr / peak lr")->capture_default_str();
  sub->add_option("--warmup", o->warmup_fraction, "warmup as a fraction of all steps")->capture_default_str();
  sub->add_option("--weight-decay", o->weight_decay, "decoupled weight decay (matrices)")->capture_default_str();
  sub->add_option("--router-lr-scale", o->router_lr_scale,
                  "lr multiplier for the MoE router matrices (QB balances best when the router moves slowly)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  sub->add_option("--clip", o->clip, "gradient clipping: max global norm (0: off)")->capture_default_str();
  sub->add_option("--balance", *balance, "router balancing: qb-exact, qb-histogram, sign, none")->capture_default_str();
  sub->add_option("--qb-ema", o->balance.ema_decay,
                  "QB: b <- centre((1-d)*new + d*old), the optional EMA of K3 App. D; averages out batch-to-batch "
                  "noise in small steps (0: off, as K3)")
      ->check(CLI::Range(0.0, 0.999))
      ->capture_default_str();
  sub->add_option("--qb-bins", o->balance.num_bins, "qb-histogram: bins per expert")
      ->check(CLI::Range(int64_t(2), int64_t(1000000)))
      ->capture_default_str();
  sub->add_option("--seed", o->seed, "initialisation seed")->capture_default_str();
  sub->add_option("--save-every", o->save_every, "checkpoint every N steps (and at the end)")->capture_default_str();
  sub->add_option("--eval-data", o->eval_path, "held-out token shard: loss at the end, beside its unigram entropy");
  sub->add_option("--eval-tokens", o->eval_tokens, "held-out tokens to evaluate")->capture_default_str();
  sub->add_option("--eval-every", o->eval_every,
                  "also evaluate the held-out loss every N steps (0: only after the last step)")
      ->capture_default_str();
  auto sequential = std::make_shared<bool>(false);
  sub->add_flag("--sequential", *sequential, "read windows in shard order (default: shuffled by --seed)");
  sub->add_flag("--resume", o->resume,
                "continue from OUT/latest; the run's --config, --seed, --tokens-per-step and --sequential must be "
                "repeated, and its plan (--stages, --lr, ... the other training flags) too unless --change-plan");
  sub->add_flag("--change-plan", o->change_plan,
                "with --resume: continue on the stages and schedule this command gives (e.g. to train longer)");
  sub->add_option("--grad-lanes", o->grad_lanes,
                  "sequences of a step run side by side on this many gradient buffers (one extra model-sized\n"
                  "float64 buffer each); 0 = the thread count, or the run's own count on --resume")
      ->capture_default_str();
  auto device = std::make_shared<std::string>("cpu");
  auto precision = std::make_shared<std::string>();
  sub->add_option("--device", *device,
                  "where the steps run: cpu (float64) or cuda (one Hopper GPU; needs a CUDA build). A checkpoint "
                  "of either resumes on either")
      ->check(CLI::IsMember({"cpu", "cuda"}))
      ->capture_default_str();
  sub->add_option("--precision", *precision,
                  "cuda only: bf16 (the default; bf16 GEMM operands on tensor cores, fp32 master weights, "
                  "gradients, optimizer state, norms, softmaxes, router and KDA state) or f32 (everything fp32, "
                  "TF32 off: the parity mode). The CPU trains in float64")
      ->check(CLI::IsMember({"bf16", "f32"}));
  sub->add_flag("--recompute", o->cuda.recompute,
                "cuda only: recompute each layer's attention and FFN in the backward instead of keeping their "
                "activations (the same results; for long sequences)");
  sub->add_option("--micro-batch-tokens", o->cuda.micro_batch_tokens,
                  "cuda only: run each step's sequences in passes of at most this many tokens and sum their "
                  "gradients before the update (gradient accumulation: steps larger than one pass's activations "
                  "fit; a longer sequence is a pass of its own). 0: the whole step in one pass")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  sub->add_flag("--batch-invariant", o->cuda.batch_invariant,
                "cuda + bf16 only: every GEMM on fixed-tile kernels and the head's vocabulary chunks fixed, so a "
                "sequence's losses are the same bits whatever else a step holds (for RL: rollout and trainer "
                "log-probabilities agree); slower, and every weight dimension must be a multiple of 8");
  sub->add_flag("--skip-nonfinite", o->skip_nonfinite,
                "skip steps with a NaN/Inf loss or gradient instead of stopping");
  sub->callback([o, stages, balance, sequential, device, precision] {
    o->shuffle = !*sequential;
    o->gpu = *device == "cuda";
    if (o->cuda.recompute && !o->gpu) fail("--recompute is for --device cuda (the CPU trainer keeps every activation)");
    if (o->cuda.batch_invariant && !o->gpu)
      fail("--batch-invariant is for --device cuda (the CPU trains each sequence on its own in float64)");
    if (o->cuda.micro_batch_tokens > 0 && !o->gpu)
      fail("--micro-batch-tokens is for --device cuda (the CPU trainer runs a step's sequences on --grad-lanes)");
    if (!precision->empty()) {
      if (!o->gpu) fail("--precision ", *precision, ": the CPU trains in float64; --precision is for --device cuda");
      o->cuda.precision = parse_gpu_precision(*precision, "--precision");
    }
    if (!stages->empty()) o->stages = train::parse_stages(*stages);
    o->balance.method = train::parse_balance_method(*balance);
    const train::TrainResult r = train::train(*o);
    if (r.steps_run == 0)
      std::printf("nothing to train: the run is already complete at step %lld (last loss %.4f); checkpoint %s\n",
                  (long long)r.steps, r.last_loss, r.last_checkpoint.c_str());
    else
      std::printf("trained %lld steps (%lld in this run); final loss %.4f; checkpoint %s\n", (long long)r.steps,
                  (long long)r.steps_run, r.last_loss, r.last_checkpoint.c_str());
    if (!o->eval_path.empty())
      std::printf("held-out loss %.4f nats/token; unigram entropy %.4f nats/token\n", r.eval.loss,
                  r.eval.unigram_entropy);
  });
}

}  // namespace k3::cli
