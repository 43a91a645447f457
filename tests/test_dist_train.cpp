// Data-parallel training on the CPU under mpirun: a step at 1, 2 and 4 ranks equals one process running the
// whole step (bit for bit where the sum's order is the same), a checkpoint written at 4 ranks resumes at 2, and a
// rank that fails or dies stops the job instead of leaving the others waiting.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>

#include <chrono>
#include <cmath>
#include <fstream>
#include <thread>

#include "model/params.h"
#include "train/checkpoint.h"
#include "util/mpi_launch.h"
#include "util/sft_corpus.h"
#include "util/train_corpus.h"

namespace fs = std::filesystem;
using k3test::Corpus;
using k3test::losses;
using k3test::run_k3;
using k3test::run_k3_ranks;
using k3test::train_args;

namespace {

// The float64 parameters and the run state of a run's latest checkpoint.
struct Saved {
  k3::train::ParamStore P;
  k3::train::TrainState state;
};
Saved latest(const std::string& out) {
  Saved s;
  const std::string dir = k3::train::latest_checkpoint(out);
  s.P = k3::train::ParamStore::from_model_dir(dir);
  k3::train::load_checkpoint(dir, s.P, s.state);
  return s;
}

std::vector<std::string> with(std::vector<std::string> args, const std::vector<std::string>& more) {
  args.insert(args.end(), more.begin(), more.end());
  return args;
}

// Largest |a − b| over the parameters, relative to the largest |b|: how far two runs that sum in different
// orders drift apart (per-element ratios would be dominated by entries that happen to be near zero).
double drift(const std::vector<double>& a, const std::vector<double>& b) {
  EXPECT_EQ(a.size(), b.size());
  double d = 0, scale = 0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
    d = std::max(d, std::abs(a[i] - b[i]));
    scale = std::max(scale, std::abs(b[i]));
  }
  return d / scale;
}

}  // namespace

// The bar: the same global batch at 1, 2 and 4 ranks. Two ranks of one lane each sum the two lanes' gradients as one
// process with two lanes does (a + b is commutative), so values, optimizer state and balancer biases are equal bit
// for bit; four ranks sum four partial gradients in MPI's order, so they agree to rounding. The losses are sums of
// per-sequence losses, taken per rank and then over the ranks: equal to rounding.
TEST(DataParallel, RanksGiveTheSingleProcessStep) {
  Corpus c;
  const std::string solo2 = c.dir.file("solo2"), solo4 = c.dir.file("solo4");
  ASSERT_EQ(run_k3(with(train_args(c, solo2), {"--grad-lanes", "2"})).status, 0);
  ASSERT_EQ(run_k3(with(train_args(c, solo4), {"--grad-lanes", "4"})).status, 0);
  const std::string r1 = c.dir.file("r1"), r2 = c.dir.file("r2"), r4 = c.dir.file("r4");
  k3test::Outcome o = run_k3_ranks(1, with(train_args(c, r1), {"--grad-lanes", "2"}));
  ASSERT_EQ(o.status, 0) << o.output;
  o = run_k3_ranks(2, with(train_args(c, r2), {"--grad-lanes", "1"}));
  ASSERT_EQ(o.status, 0) << o.output;
  EXPECT_NE(o.output.find("data-parallel over 2 ranks"), std::string::npos) << o.output;
  // Only rank 0 reports: one line per step, not two.
  EXPECT_EQ(o.output.find("step 1/12"), o.output.rfind("step 1/12")) << o.output;
  o = run_k3_ranks(4, with(train_args(c, r4), {"--grad-lanes", "1"}));
  ASSERT_EQ(o.status, 0) << o.output;

  const std::vector<double> want = losses(solo2);
  ASSERT_EQ(want.size(), 12u);
  EXPECT_EQ(losses(r1), want);  // one rank under mpirun is the process itself
  const std::vector<double> l2 = losses(r2), l4 = losses(r4);
  ASSERT_EQ(l2.size(), want.size());
  ASSERT_EQ(l4.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_NEAR(l2[i], want[i], 1e-13 * std::abs(want[i])) << "step " << i + 1;
    EXPECT_NEAR(l4[i], losses(solo4)[i], 1e-12 * std::abs(want[i])) << "step " << i + 1;
  }

  const Saved a = latest(solo2), b = latest(r2), d = latest(solo4), e = latest(r4);
  EXPECT_EQ(b.P.values(), a.P.values());  // bitwise
  EXPECT_EQ(b.state.optimizer, a.state.optimizer);
  EXPECT_EQ(b.state.meta["balancers"], a.state.meta["balancers"]);
  EXPECT_EQ(b.state.meta["ranks"], 2);
  // Four ranks against one process with four lanes, beside one process with two lanes against it: the drift that
  // the order of a sum alone gives over these 12 steps.
  const double ranks = drift(e.P.values(), d.P.values()), lanes = drift(a.P.values(), d.P.values());
  std::printf("4 ranks vs 4 lanes: %.3g; 2 lanes vs 4 lanes: %.3g\n", ranks, lanes);
  EXPECT_LT(ranks, 1e-12);
}

// The histogram estimator sums its counts over the ranks: 2 ranks again equal one process of 2 lanes bit for bit.
TEST(DataParallel, HistogramBalancingSumsItsCounts) {
  Corpus c;
  const std::string solo = c.dir.file("solo"), r2 = c.dir.file("r2");
  auto args = [&](const std::string& out, const char* lanes) {
    std::vector<std::string> a = with(train_args(c, out), {"--grad-lanes", lanes, "--balance", "qb-histogram"});
    a[8] = "32:512";  // --stages: 4 steps
    return a;
  };
  ASSERT_EQ(run_k3(args(solo, "2")).status, 0);
  const k3test::Outcome o = run_k3_ranks(2, args(r2, "1"));
  ASSERT_EQ(o.status, 0) << o.output;
  const Saved a = latest(solo), b = latest(r2);
  EXPECT_EQ(b.state.meta["balancers"], a.state.meta["balancers"]);
  EXPECT_EQ(b.P.values(), a.P.values());
  EXPECT_NE(a.state.meta["balancers"].dump().find("qb-histogram"), std::string::npos);
}

// SFT shares its conversations out with their assistant masks: 2 ranks of one lane equal one process of two lanes
// bit for bit; the held-out loss, each rank evaluating its share, to rounding.
TEST(DataParallel, SftRanksGiveTheSingleProcessStep) {
  k3test::SftCorpus c;
  const std::string solo = c.dir.file("solo"), r2 = c.dir.file("r2");
  auto args = [&](const std::string& out, const char* lanes) {
    std::vector<std::string> a = k3test::sft_args(c, out);
    a[a.size() - 5] = lanes;  // --grad-lanes
    a[8] = "1";               // --epochs: 1
    return a;
  };
  ASSERT_EQ(run_k3(args(solo, "2")).status, 0);
  const k3test::Outcome o = run_k3_ranks(2, args(r2, "1"));
  ASSERT_EQ(o.status, 0) << o.output;
  const Saved a = latest(solo), b = latest(r2);
  EXPECT_EQ(b.P.values(), a.P.values());
  EXPECT_EQ(b.state.optimizer, a.state.optimizer);
  const auto ea = k3test::eval_losses(solo), eb = k3test::eval_losses(r2);
  ASSERT_EQ(eb.size(), ea.size());
  ASSERT_FALSE(ea.empty());
  for (size_t i = 0; i < ea.size(); ++i) EXPECT_NEAR(eb[i].second, ea[i].second, 1e-13 * ea[i].second);
}

// A checkpoint written at 4 ranks resumes at 2 (and at 1): the continuation equals the 4-rank run's own to rounding.
TEST(DataParallel, CheckpointOfFourRanksResumesOnTwo) {
  Corpus c;
  const std::string r4 = c.dir.file("r4");
  const std::vector<std::string> args = with(train_args(c, r4), {"--grad-lanes", "1"});
  ASSERT_EQ(run_k3_ranks(4, args).status, 0);
  const std::vector<double> want = losses(r4);
  ASSERT_EQ(want.size(), 12u);
  for (int ranks : {2, 1}) {
    // A copy of the run, cut back to its step-5 checkpoint.
    const std::string cut = c.dir.file("cut" + std::to_string(ranks));
    fs::copy(r4, cut, fs::copy_options::recursive);
    std::ofstream(cut + "/latest") << k3::train::step_name(5);
    std::vector<std::string> resume = train_args(c, cut);
    resume.insert(resume.end(), {"--grad-lanes", "1", "--resume"});
    const k3test::Outcome o = ranks == 1 ? run_k3(resume) : run_k3_ranks(ranks, resume);
    ASSERT_EQ(o.status, 0) << o.output;
    EXPECT_NE(o.output.find("resumed from"), std::string::npos) << o.output;
    EXPECT_NE(o.output.find("the run used 4"), std::string::npos) << o.output;  // the rank count changed
    const std::vector<double> got = losses(cut);
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < want.size(); ++i) {
      if (i < 5) EXPECT_EQ(got[i], want[i]) << "step " << i + 1;  // kept from the 4-rank run
      else EXPECT_NEAR(got[i], want[i], 1e-12 * std::abs(want[i])) << ranks << " ranks, step " << i + 1;
    }
    EXPECT_LT(drift(latest(cut).P.values(), latest(r4).P.values()), 1e-12) << ranks << " ranks";
  }
}

// A rank that fails names itself and stops the job; ranks started with different command lines are refused.
TEST(DataParallel, AFailingRankStopsTheJob) {
  Corpus c;
  const std::string out = c.dir.file("bad");
  // Rank 1 alone fails (a bad K3_GEMM in its environment; mpirun's MPMD form: one command per rank) while rank 0
  // goes on to wait for it.
  const auto start = std::chrono::steady_clock::now();
  k3test::Outcome o = k3test::run_shell(k3test::mpirun_prefix(1) + k3test::k3_command(train_args(c, out)) + " : " +
                                        "-np 1 " + k3test::k3_command(train_args(c, out), "K3_GEMM=bogus"));
  EXPECT_NE(o.status, 0);
  EXPECT_NE(o.output.find("error (rank 1 of 2)"), std::string::npos) << o.output;
  EXPECT_NE(o.output.find("K3_GEMM"), std::string::npos) << o.output;
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 120.0);

  std::vector<std::string> other_seed = train_args(c, out);
  other_seed.back() = "4";  // --seed
  o = k3test::run_shell(k3test::mpirun_prefix(1) + k3test::k3_command(train_args(c, out)) + " : -np 1 " +
                        k3test::k3_command(other_seed));
  EXPECT_NE(o.status, 0);
  EXPECT_NE(o.output.find("the command line differs between rank 0 and rank 1"), std::string::npos) << o.output;
}

// A rank killed in the middle of the run (SIGKILL: no chance to report) makes mpirun stop the other, which would
// otherwise wait forever in the step's gradient sum.
TEST(DataParallel, AKilledRankStopsTheJob) {
  Corpus c;
  const std::string out = c.dir.file("killed"), log = c.dir.file("log"), pidfile = c.dir.file("pid");
  std::vector<std::string> args = train_args(c, out);
  args[8] = "32:100000";  // --stages: a long run
  const std::string cmd = k3test::mpirun_prefix(2) + k3test::k3_command(args);
  ASSERT_EQ(std::system((cmd + " >" + log + " 2>&1 & echo $! > " + pidfile).c_str()), 0);
  std::string pid;
  std::ifstream(pidfile) >> pid;
  for (int i = 0; i < 6000 && losses(out).size() < 2; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  ASSERT_GE(losses(out).size(), 2u);
  // mpirun's children are the ranks (each an `env` that became k3); kill the last one.
  ASSERT_EQ(std::system(("kill -9 $(pgrep -P " + pid + " | tail -1)").c_str()), 0);
  bool ended = false;
  for (int i = 0; i < 1200 && !ended; ++i) {  // up to 60 s
    ended = ::kill(std::stoi(pid), 0) != 0;
    if (!ended) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  if (!ended) std::system(("kill -9 " + pid).c_str());
  ASSERT_TRUE(ended) << "the surviving rank did not stop within 60 s of its peer's death";
  std::ifstream in(log);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_NE(text.find("signal 9"), std::string::npos) << text;
}
