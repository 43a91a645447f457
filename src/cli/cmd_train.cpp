// k3 data / k3 train / k3 sft: build a token shard from text files; train a model from a config on it; fine-tune a
// model on chat conversations.
#include <cstdio>
#include <filesystem>
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

namespace {

// The flags `k3 train` and `k3 sft` share (the optimizer, balancing, checkpoints, evaluation, the device), and
// their checks once parsed.
struct TrainFlags {
  std::shared_ptr<train::TrainOptions> o = std::make_shared<train::TrainOptions>();
  std::shared_ptr<std::string> balance = std::make_shared<std::string>("qb-exact");
  std::shared_ptr<std::string> device = std::make_shared<std::string>("cpu");
  std::shared_ptr<std::string> precision = std::make_shared<std::string>();
  std::shared_ptr<bool> sequential = std::make_shared<bool>(false);

  void add(CLI::App* sub, const char* order_help, const char* resume_help) {
    train::TrainOptions& t = *o;
    sub->add_option("--tokens-per-step", t.tokens_per_step, "tokens per optimizer step")->capture_default_str();
    sub->add_option("--lr", t.lr, "peak learning rate")->capture_default_str();
    sub->add_option("--min-lr-ratio", t.min_lr_ratio, "final lr / peak lr")->capture_default_str();
    sub->add_option("--warmup", t.warmup_fraction, "warmup as a fraction of all steps")->capture_default_str();
    sub->add_option("--weight-decay", t.weight_decay, "decoupled weight decay (matrices)")->capture_default_str();
    sub->add_option("--router-lr-scale", t.router_lr_scale,
                    "lr multiplier for the MoE router matrices (QB balances best when the router moves slowly)")
        ->check(CLI::PositiveNumber)
        ->capture_default_str();
    sub->add_option("--clip", t.clip, "gradient clipping: max global norm (0: off)")->capture_default_str();
    sub->add_option("--balance", *balance, "router balancing: qb-exact, qb-histogram, sign, none")
        ->capture_default_str();
    sub->add_option("--qb-ema", t.balance.ema_decay,
                    "QB: b <- centre((1-d)*new + d*old), the optional EMA of K3 App. D; averages out batch-to-batch "
                    "noise in small steps (0: off, as K3)")
        ->check(CLI::Range(0.0, 0.999))
        ->capture_default_str();
    sub->add_option("--qb-bins", t.balance.num_bins, "qb-histogram: bins per expert")
        ->check(CLI::Range(int64_t(2), int64_t(1000000)))
        ->capture_default_str();
    sub->add_option("--save-every", t.save_every, "checkpoint every N steps (and at the end)")->capture_default_str();
    sub->add_option("--eval-every", t.eval_every,
                    "also evaluate the held-out loss every N steps (0: only after the last step)")
        ->capture_default_str();
    sub->add_flag("--sequential", *sequential, order_help);
    sub->add_flag("--resume", t.resume, resume_help);
    sub->add_flag("--change-plan", t.change_plan,
                  "with --resume: continue on the plan this command gives (e.g. to train longer)");
    sub->add_option("--grad-lanes", t.grad_lanes,
                    "sequences of a step run side by side on this many gradient buffers (one extra model-sized\n"
                    "float64 buffer each); 0 = the thread count, or the run's own count on --resume")
        ->capture_default_str();
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
    sub->add_flag("--recompute", t.cuda.recompute,
                  "cuda only: recompute each layer's attention and FFN in the backward instead of keeping their "
                  "activations (the same results; for long sequences)");
    sub->add_option("--micro-batch-tokens", t.cuda.micro_batch_tokens,
                    "cuda only: run each step's sequences in passes of at most this many tokens and sum their "
                    "gradients before the update (gradient accumulation: steps larger than one pass's activations "
                    "fit; a longer sequence is a pass of its own). 0: the whole step in one pass")
        ->check(CLI::NonNegativeNumber)
        ->capture_default_str();
    sub->add_flag("--batch-invariant", t.cuda.batch_invariant,
                  "cuda + bf16 only: every GEMM on fixed-tile kernels and the head's vocabulary chunks fixed, so a "
                  "sequence's losses are the same bits whatever else a step holds (for RL: rollout and trainer "
                  "log-probabilities agree); slower, and every weight dimension must be a multiple of 8");
    sub->add_flag("--skip-nonfinite", t.skip_nonfinite,
                  "skip steps with a NaN/Inf loss or gradient instead of stopping");
  }

  // After parsing: the device flags checked, the words turned into options.
  void finish() const {
    train::TrainOptions& t = *o;
    t.shuffle = !*sequential;
    t.gpu = *device == "cuda";
    if (t.cuda.recompute && !t.gpu) fail("--recompute is for --device cuda (the CPU trainer keeps every activation)");
    if (t.cuda.batch_invariant && !t.gpu)
      fail("--batch-invariant is for --device cuda (the CPU trains each sequence on its own in float64)");
    if (t.cuda.micro_batch_tokens > 0 && !t.gpu)
      fail("--micro-batch-tokens is for --device cuda (the CPU trainer runs a step's sequences on --grad-lanes)");
    if (!precision->empty()) {
      if (!t.gpu) fail("--precision ", *precision, ": the CPU trains in float64; --precision is for --device cuda");
      t.cuda.precision = parse_gpu_precision(*precision, "--precision");
    }
    t.balance.method = train::parse_balance_method(*balance);
  }
};

void print_result(const train::TrainResult& r, const train::TrainOptions& o, bool sft) {
  if (r.steps_run == 0)
    std::printf("nothing to train: the run is already complete at step %lld (last loss %.4f); checkpoint %s\n",
                (long long)r.steps, r.last_loss, r.last_checkpoint.c_str());
  else
    std::printf("trained %lld steps (%lld in this run); final loss %.4f; checkpoint %s\n", (long long)r.steps,
                (long long)r.steps_run, r.last_loss, r.last_checkpoint.c_str());
  if (o.eval_path.empty()) return;
  if (sft) std::printf("held-out loss %.4f nats per assistant token\n", r.eval.loss);
  else
    std::printf("held-out loss %.4f nats/token; unigram entropy %.4f nats/token\n", r.eval.loss,
                r.eval.unigram_entropy);
}

}  // namespace

void register_train(CLI::App& app) {
  TrainFlags f;
  train::TrainOptions& o = *f.o;
  auto stages = std::make_shared<std::string>();
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
  sub->add_option("--config", o.config_path, "model config.json")->required();
  sub->add_option("--data", o.data_path, "token shard (k3 data)")->required();
  sub->add_option("--out", o.out_dir, "run directory")->required();
  sub->add_option("--stages", *stages, "curriculum, e.g. 64:100000,256:50000 (default: one stage of length 256)");
  sub->add_option("--tokens", o.tokens, "total tokens when --stages is not given")->capture_default_str();
  sub->add_option("--seed", o.seed, "initialisation seed")->capture_default_str();
  sub->add_option("--eval-data", o.eval_path, "held-out token shard: loss at the end, beside its unigram entropy");
  sub->add_option("--eval-tokens", o.eval_tokens, "held-out tokens to evaluate")->capture_default_str();
  f.add(sub, "read windows in shard order (default: shuffled by --seed)",
        "continue from OUT/latest; the run's --config, --seed, --tokens-per-step and --sequential must be "
        "repeated, and its plan (--stages, --lr, ... the other training flags) too unless --change-plan");
  sub->callback([f, stages] {
    f.finish();
    if (!stages->empty()) f.o->stages = train::parse_stages(*stages);
    print_result(train::train(*f.o), *f.o, false);
  });
}

void register_sft(CLI::App& app) {
  TrainFlags f;
  train::TrainOptions& o = *f.o;
  o.lr = 1e-4;
  o.warmup_fraction = 0.03;
  o.tokens_per_step = 4096;
  auto model = std::make_shared<std::string>();
  auto tokenizer = std::make_shared<std::string>();
  CLI::App* sub = app.add_subcommand(
      "sft",
      "Supervised fine-tuning of a K3 model on chat conversations: DATA is JSONL, one OpenAI-style chat\n"
      "request per line (messages with system, user, assistant and tool turns; assistant reasoning_content\n"
      "and tool_calls; optional tools, thinking, thinking_effort). Each conversation is rendered in XTML as\n"
      "for generation and is one sequence (nothing attends across conversations); whole conversations are\n"
      "packed into steps of at most --tokens-per-step tokens, and the loss is the mean over the assistant's\n"
      "tokens only (what the model writes after a generation prompt, through <|end_of_msg|>). Runs on the\n"
      "trainer of `k3 train` (same optimizer, balancing, devices, checkpoints and exact --resume), starting\n"
      "from MODEL's weights. Writes OUT/step-N/, OUT/latest and OUT/metrics.jsonl.");
  sub->add_option("--model", *model, "model directory to start from (config.json + safetensors)")->required();
  sub->add_option("--data", o.sft_data, "training conversations (JSONL)")->required();
  sub->add_option("--out", o.out_dir, "run directory")->required();
  sub->add_option("--tokenizer", *tokenizer, "tokenizer directory (default: MODEL's own tiktoken.model)");
  sub->add_option("--epochs", o.epochs, "passes over the conversations")->capture_default_str();
  sub->add_option("--max-seq-len", o.max_seq_len,
                  "conversations longer than this many tokens are cut (0: the config's max_position_embeddings)")
      ->capture_default_str();
  sub->add_option("--seed", o.seed, "the conversations' order in each epoch")->capture_default_str();
  sub->add_option("--eval-data", o.eval_path, "held-out conversations (JSONL): the loss over their assistant tokens");
  f.add(sub, "take the conversations in file order (default: a new order each epoch, from --seed)",
        "continue from OUT/latest; the run's --seed, --tokens-per-step, --sequential and data must be repeated, "
        "and its plan (--epochs, --lr, ... the other training flags) too unless --change-plan");
  sub->callback([f, model, tokenizer] {
    f.finish();
    train::TrainOptions& t = *f.o;
    t.init_model = *model;
    t.config_path = (std::filesystem::path(*model) / "config.json").string();
    const std::string tok_dir = tokenizer->empty() ? *model : *tokenizer;
    if (!Tokenizer::dir_has_tokenizer(tok_dir))
      fail(tok_dir, ": no tiktoken.model to encode the conversations with; give --tokenizer DIR");
    t.tokenizer_dir = tok_dir;  // loaded, and checked against the model's vocabulary, by the trainer
    print_result(train::train(t), t, true);
  });
}

}  // namespace k3::cli
