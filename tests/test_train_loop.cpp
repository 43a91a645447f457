// k3 train end to end on the golden tiny model's config: it learns (loss falls), a run killed
// with SIGKILL and resumed gives exactly the losses of an uninterrupted run, a checkpoint write cut
// short leaves the previous checkpoint usable, and checkpoints load for inference.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <thread>

#include "core/cuda.h"
#include "core/error.h"
#include "model/params.h"
#include "train/checkpoint.h"
#include "util/cli.h"
#include "util/compare.h"
#include "util/temp_dir.h"
#include "util/train_corpus.h"

using k3test::fixture;
using k3test::run_k3;
namespace fs = std::filesystem;

using k3test::Corpus;
using k3test::losses;
using k3test::train_args;

TEST(TrainLoop, LearnsAndCheckpointsLoadForInference) {
  Corpus c;
  const std::string out = c.dir.file("run");
  const k3test::Outcome r = run_k3(train_args(c, out));
  ASSERT_EQ(r.status, 0) << r.output;
  const std::vector<double> l = losses(out);
  ASSERT_EQ(l.size(), 12u);  // 6 + 6 steps of 128 tokens
  EXPECT_LT(l.back(), l.front() - 0.5) << "loss did not fall: " << l.front() << " -> " << l.back();
  const std::string ckpt = k3::train::latest_checkpoint(out);
  EXPECT_EQ(fs::path(ckpt).filename(), "step-00000012");
  const k3test::Outcome g =
      run_k3({"generate", "--model", ckpt, "--ids", "1,2,3", "--max-new-tokens", "3", "--print-ids"});
  EXPECT_EQ(g.status, 0) << g.output;
}

// Both runs sum their gradients in 3 lanes (train/grad_lanes.h). The resumed run is not told the
// lane count and runs on 2 threads, not 1: it must take the count from the checkpoint.
TEST(TrainLoop, ResumeAfterSigkillGivesIdenticalLosses) {
  Corpus c;
  const std::string a = c.dir.file("a"), b = c.dir.file("b");
  auto lanes3 = [&](std::vector<std::string> args) {
    args.insert(args.end(), {"--grad-lanes", "3"});
    return args;
  };
  ASSERT_EQ(run_k3(lanes3(train_args(c, a))).status, 0);
  const std::vector<double> want = losses(a);
  // Start b in the background and SIGKILL it once a few steps are logged.
  const std::string cmd = k3test::k3_command(lanes3(train_args(c, b)));
  const std::string pidfile = c.dir.file("pid");
  ASSERT_EQ(std::system((cmd + " >/dev/null 2>&1 & echo $! > " + pidfile).c_str()), 0);
  std::string pid;
  std::ifstream(pidfile) >> pid;
  // Wait (up to 5 minutes on a loaded machine) until a few steps and their checkpoints exist.
  for (int i = 0; i < 6000 && losses(b).size() < 3; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  ASSERT_EQ(std::system(("kill -9 " + pid + " 2>/dev/null; sleep 0.2").c_str()), 0);
  const size_t before = losses(b).size();
  ASSERT_GE(before, 3u);
  ASSERT_LT(before, want.size()) << "the run finished before it was killed; nothing to resume";
  std::vector<std::string> args = train_args(c, b);
  args.push_back("--resume");
  const k3test::Outcome r = k3test::run_shell("OMP_NUM_THREADS=2 " + k3test::k3_command(args));
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("resumed from"), std::string::npos);
  EXPECT_EQ(losses(b), want);  // bit-identical loss sequence
}

TEST(TrainLoop, InterruptedCheckpointWriteLeavesThePreviousOne) {
  Corpus c;
  const std::string out = c.dir.file("run");
  std::vector<std::string> args = train_args(c, out);
  args[8] = "32:768";  // 6 steps
  ASSERT_EQ(run_k3(args).status, 0);
  const std::string good = k3::train::latest_checkpoint(out);
  // What a kill in the middle of writing step 7 leaves: a partial temporary directory.
  fs::create_directories(fs::path(out) / ".tmp-step-00000007");
  std::ofstream(out + "/.tmp-step-00000007/train_state.bin") << "K3TRNS01 partial";
  EXPECT_EQ(k3::train::latest_checkpoint(out), good);
  k3::train::ParamStore P = k3::train::ParamStore::from_model_dir(good);
  k3::train::TrainState st;
  EXPECT_NO_THROW(k3::train::load_checkpoint(good, P, st));
  EXPECT_EQ(st.meta["step"], 6);
  // Resuming with a longer plan (said with --change-plan) continues from the good checkpoint and
  // clears the leftover.
  args[8] = "32:1024";
  args.push_back("--resume");
  args.push_back("--change-plan");
  const k3test::Outcome r = run_k3(args);
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_FALSE(fs::exists(fs::path(out) / ".tmp-step-00000007"));
  EXPECT_EQ(fs::path(k3::train::latest_checkpoint(out)).filename(), "step-00000008");
  // A truncated state file is an error that names it.
  std::filesystem::resize_file(good + "/train_state.bin", 100);
  try {
    k3::train::load_checkpoint(good, P, st);
    FAIL();
  } catch (const k3::Error& e) {
    EXPECT_NE(std::string(e.what()).find("train_state.bin"), std::string::npos) << e.what();
  }
}

// --eval-every: a held-out evaluation every N steps and one after the last step, never two at one
// step of a run. Its truth: a copy of the run cut back to its step-4 checkpoint and resumed with a
// plan that ends there trains nothing and evaluates once more (a resumed run evaluates its end
// again: the held-out flags may have changed); that loss must be the periodic one, bit for bit.
TEST(TrainLoop, PeriodicEvaluationMatchesAnEvaluationOfItsCheckpoint) {
  Corpus c;
  const std::string a = c.dir.file("a"), b = c.dir.file("b");
  std::vector<std::string> args = train_args(c, a);
  args[8] = "32:1280";  // 10 steps: evaluations after steps 4, 8 and 10
  args.insert(args.end(), {"--eval-data", c.shard, "--eval-tokens", "256", "--eval-every", "4"});
  ASSERT_EQ(run_k3(args).status, 0);
  const std::vector<std::pair<int64_t, double>> ev = k3test::eval_losses(a);
  ASSERT_EQ(ev.size(), 3u);
  EXPECT_EQ(ev[0].first, 4);
  EXPECT_EQ(ev[1].first, 8);
  EXPECT_EQ(ev[2].first, 10);
  EXPECT_EQ(k3test::losses(a).size(), 10u);
  fs::copy(a, b, fs::copy_options::recursive);
  for (int s = 5; s <= 10; ++s) {
    char name[32];
    std::snprintf(name, sizeof name, "step-%08d", s);
    ASSERT_TRUE(fs::remove_all(fs::path(b) / name) > 0) << name;
  }
  std::ofstream(b + "/latest") << "step-00000004\n";
  ASSERT_EQ(fs::path(k3::train::latest_checkpoint(b)).filename(), "step-00000004");
  args = train_args(c, b);
  args[8] = "32:512";  // a plan of 4 steps: complete already
  args.insert(args.end(), {"--eval-data", c.shard, "--eval-tokens", "256", "--resume", "--change-plan"});
  const k3test::Outcome r = run_k3(args);
  ASSERT_EQ(r.status, 0) << r.output;
  const std::vector<std::pair<int64_t, double>> evb = k3test::eval_losses(b);
  ASSERT_EQ(evb.size(), 2u);  // the step-4 record kept from the copy (later ones dropped) and the new one
  EXPECT_EQ(evb.back().first, 4);
  EXPECT_EQ(evb.back().second, ev[0].second);
  // --eval-every without held-out data is an error, not a silent no-op.
  args = train_args(c, c.dir.file("e"));
  args.insert(args.end(), {"--eval-every", "2"});
  const k3test::Outcome e = run_k3(args);
  EXPECT_NE(e.status, 0);
  EXPECT_NE(e.output.find("--eval-every needs --eval-data"), std::string::npos) << e.output;
}

TEST(TrainLoop, BadOptionsAreClearErrors) {
  Corpus c;
  std::vector<std::string> args = train_args(c, c.dir.file("x"));
  args[8] = "32";
  k3test::Outcome r = run_k3(args);
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.output.find("SEQ_LEN:TOKENS"), std::string::npos) << r.output;
  args = train_args(c, c.dir.file("y"));
  args.push_back("--resume");
  r = run_k3(args);
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.output.find("no checkpoint"), std::string::npos) << r.output;
  args = train_args(c, c.dir.file("z"));
  args[4] = fixture("k3-tiny-a/config.json");  // a config is not a shard
  r = run_k3(args);
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.output.find("not a k3 token shard"), std::string::npos) << r.output;
  // --precision belongs to --device cuda; the CPU trains in float64.
  args = train_args(c, c.dir.file("p"));
  args.insert(args.end(), {"--precision", "bf16"});
  r = run_k3(args);
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.output.find("--precision is for --device cuda"), std::string::npos) << r.output;
  args = train_args(c, c.dir.file("m"));
  args.insert(args.end(), {"--micro-batch-tokens", "64"});
  r = run_k3(args);
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.output.find("--micro-batch-tokens is for --device cuda"), std::string::npos) << r.output;
  args = train_args(c, c.dir.file("bi"));
  args.insert(args.end(), {"--batch-invariant"});
  r = run_k3(args);
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.output.find("--batch-invariant is for --device cuda"), std::string::npos) << r.output;
  args = train_args(c, c.dir.file("m2"));
  args.insert(args.end(), {"--device", "cuda", "--micro-batch-tokens", "-5"});
  r = run_k3(args);
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.output.find("--micro-batch-tokens"), std::string::npos) << r.output;
  args = train_args(c, c.dir.file("d"));
  args.insert(args.end(), {"--device", "gpu"});
  r = run_k3(args);
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.output.find("--device"), std::string::npos) << r.output;
  // Without a usable GPU, --device cuda says why before training anything.
  if (!k3::cuda::available()) {
    args = train_args(c, c.dir.file("g"));
    args.insert(args.end(), {"--device", "cuda"});
    r = run_k3(args);
    EXPECT_EQ(r.status, 1) << r.output;
    EXPECT_NE(r.output.find("GPU training cannot start"), std::string::npos) << r.output;
  }
}
