// The float64 engine (model/training/engine_f64.h) on the k3-tiny-a fixture (KDA and MLA layers, dense and MoE):
//   - sequences fed in uneven pieces, two at a time, give the logits the trainer's float64 forward gives for the
//     whole sequence at once (model_train.h: sequence_loss; its KDA recurrence runs chunked, the engine's token by
//     token), and the f32 engine's to its own precision;
//   - a sampled id's log-probability is the float64 log-softmax of that row; the routing hook sees every row;
//   - snapshots restore a sequence bit for bit;
//   - what it cannot do is refused with a named error.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "kernels/loss/cross_entropy.h"
#include "model/engine.h"
#include "model/training/engine_f64.h"
#include "model/training/model_train.h"
#include "util/compare.h"
#include "util/error_of.h"

using namespace k3;
using k3test::fixture;
using ::testing::HasSubstr;

namespace {

struct Fixture {
  K3Config c = load_config(fixture("k3-tiny-a/config.json"));
  std::shared_ptr<const train::ParamStore> P =
      std::make_shared<const train::ParamStore>(train::ParamStore::from_model_dir(fixture("k3-tiny-a")));
  std::unique_ptr<Engine> e = float64_engine(P, c);

  std::vector<int32_t> random_ids(int64_t T, uint32_t seed) const {
    std::mt19937 rng(seed);
    std::uniform_int_distribution<int32_t> id(0, int32_t(c.vocab_size) - 1);
    std::vector<int32_t> ids(static_cast<size_t>(T));
    for (int32_t& t : ids) t = id(rng);
    return ids;
  }
  // The trainer's logits of the whole sequence, [T, V].
  std::vector<double> whole(const std::vector<int32_t>& ids) const {
    std::vector<double> logits;
    train::sequence_loss(const_cast<train::ParamStore&>(*P), c, ids, false, 1.0, &logits);
    return logits;
  }
};

}  // namespace

TEST(Float64Engine, PiecesGiveTheTrainersLogitsOfTheWhole) {
  Fixture f;
  const int64_t V = f.c.vocab_size;
  const std::vector<std::vector<int32_t>> ids = {f.random_ids(37, 1), f.random_ids(29, 2)};
  // Piece sizes per forward: a prompt, single decode steps, a tool result, across KDA chunk boundaries.
  const std::vector<std::vector<int64_t>> pieces = {{7, 1, 1, 1, 17, 1, 9}, {1, 12, 1, 1, 5, 1, 8}};
  auto seqs = f.e->new_sequences(2);
  std::vector<std::vector<float>> got(2);
  std::vector<int64_t> at(2, 0);
  int64_t routed_rows = 0, calls = 0;
  ForwardHooks hooks;
  hooks.topk = [&](int64_t, const int32_t*, int64_t rows, int64_t k) {
    EXPECT_EQ(k, f.c.num_experts_per_token);
    routed_rows += rows, ++calls;
  };
  int64_t fed = 0;
  for (size_t step = 0; step < pieces[0].size(); ++step) {
    std::vector<std::vector<int32_t>> t(2);
    for (size_t b = 0; b < 2; ++b) {
      t[b].assign(ids[b].begin() + at[b], ids[b].begin() + at[b] + pieces[b][step]);
      at[b] += pieces[b][step];
      fed += pieces[b][step];
    }
    const std::vector<float> l = f.e->forward({seqs[0].get(), seqs[1].get()}, t, true, &hooks);
    ASSERT_EQ(int64_t(l.size()), int64_t(t[0].size() + t[1].size()) * V);
    got[0].insert(got[0].end(), l.begin(), l.begin() + std::ptrdiff_t(t[0].size()) * V);
    got[1].insert(got[1].end(), l.begin() + std::ptrdiff_t(t[0].size()) * V, l.end());
  }
  int64_t moe_layers = 0;
  for (int64_t l = 0; l < f.c.num_hidden_layers; ++l) moe_layers += f.c.is_moe_layer(l);
  EXPECT_EQ(routed_rows, fed * moe_layers);
  EXPECT_EQ(calls, int64_t(pieces[0].size()) * moe_layers);

  const std::unique_ptr<Engine> f32 = Engine::load(fixture("k3-tiny-a"), {Device::CPU, Precision::F32});
  for (size_t b = 0; b < 2; ++b) {
    EXPECT_EQ(seqs[b]->length(), int64_t(ids[b].size()));
    const std::vector<double> want = f.whole(ids[b]);
    const std::vector<float> f32_logits = f32->forward_fresh({ids[b]});
    // The engine returns its float64 logits rounded to fp32: equal to rounding (~1e-14), each is the fp32 rounding
    // of the trainer's, or where the two straddle a rounding boundary its neighbour.
    int64_t neighbours = 0;
    double worst_f32 = 0;
    for (size_t i = 0; i < want.size(); ++i) {
      const float w = float(want[i]);
      if (got[b][i] != w) {
        ++neighbours;
        EXPECT_TRUE(got[b][i] == std::nextafter(w, INFINITY) || got[b][i] == std::nextafter(w, -INFINITY))
            << "sequence " << b << " value " << i << ": " << got[b][i] << " against " << want[i];
      }
      worst_f32 = std::max(worst_f32, std::abs(double(f32_logits[i]) - want[i]));
    }
    std::printf(
        "sequence %zu: %lld of %zu float64-engine logits differ from the trainer's in the fp32 rounding; the "
        "f32 engine's differ by up to %.3g\n",
        b, (long long)neighbours, want.size(), worst_f32);
    EXPECT_LT(neighbours, int64_t(want.size()) / 1000) << "sequence " << b;
    EXPECT_LT(worst_f32, 1e-4) << "sequence " << b;
  }
}

TEST(Float64Engine, SampledLogprobIsTheFloat64LogSoftmax) {
  Fixture f;
  const std::vector<int32_t> ids = f.random_ids(21, 3);
  const std::vector<double> want = f.whole(ids);
  const int64_t V = f.c.vocab_size, T = int64_t(ids.size());
  auto seqs = f.e->new_sequences(1);
  TokenPick p;
  p.pick = true, p.greedy = false, p.temperature = 0.7f, p.uniform = 0.37, p.want_logprob = true;
  const PickResult r = f.e->forward_pick({seqs[0].get()}, {ids}, {p})[0];
  const double* row = &want[size_t((T - 1) * V)];
  std::vector<float> rounded(row, row + V);
  EXPECT_EQ(r.id, pick_on_host(rounded, p).id);  // drawn by the host's rule from the fp32 logits
  EXPECT_NEAR(r.logprob, log_softmax_at(row, V, r.id, double(p.temperature)), 1e-12);
  EXPECT_NE(r.logprob, pick_on_host(rounded, p).logprob);  // not the fp32 logits' log-softmax

  // A teacher's log-probabilities of a whole sequence (distillation): each token's under the row before it.
  const std::vector<double> lp = f.e->sequence_logprobs(ids);
  const std::vector<double> lp32 =
      Engine::load(fixture("k3-tiny-a"), {Device::CPU, Precision::F32})->sequence_logprobs(ids);
  ASSERT_EQ(lp.size(), ids.size());
  ASSERT_EQ(lp32.size(), ids.size());
  EXPECT_EQ(lp[0], 0.0);
  for (int64_t t = 1; t < T; ++t) {
    EXPECT_NEAR(lp[size_t(t)], log_softmax_at(&want[size_t((t - 1) * V)], V, ids[size_t(t)]), 1e-12) << t;
    EXPECT_NEAR(lp32[size_t(t)], lp[size_t(t)], 1e-4) << t;
  }
}

TEST(Float64Engine, SnapshotsRestoreBitForBit) {
  Fixture f;
  const std::vector<int32_t> ids = f.random_ids(23, 4);
  auto seqs = f.e->new_sequences(2);
  EngineSequence& a = *seqs[0];
  f.e->forward({&a}, {{ids.begin(), ids.begin() + 10}}, false);
  const auto s1 = f.e->snapshot(a, 0);
  f.e->forward({&a}, {{ids.begin() + 10, ids.begin() + 17}}, false);
  const auto s2 = f.e->snapshot(a, 10);
  EXPECT_EQ(s2->begin, 10);
  EXPECT_EQ(s2->end, 17);
  EngineSequence& b = *seqs[1];
  auto fresh = f.e->new_sequences(1);
  const auto s0 = f.e->snapshot(*fresh[0], 0);  // of a sequence that has run nothing: an empty start of a chain
  f.e->restore(b, {s0.get(), s1.get(), s2.get()});
  EXPECT_EQ(b.length(), 17);
  const std::vector<int32_t> rest(ids.begin() + 17, ids.end());
  EXPECT_EQ(f.e->forward({&a}, {rest}, true), f.e->forward({&b}, {rest}, true));
  EXPECT_THAT(k3test::error_of([&] { f.e->restore(b, {s1.get()}); }), HasSubstr("must be fresh"));
  f.e->reset(b);
  EXPECT_EQ(b.length(), 0);
  EXPECT_THAT(k3test::error_of([&] { f.e->restore(b, {s2.get()}); }), HasSubstr("does not continue the chain"));
}

TEST(Float64Engine, RefusesWhatItCannotDo) {
  Fixture f;
  auto seqs = f.e->new_sequences(1);
  const std::unique_ptr<Engine> other = float64_engine(f.P, f.c);
  auto theirs = other->new_sequences(1);
  EXPECT_THAT(k3test::error_of([&] {
                f.e->forward({theirs[0].get()}, {{1, 2}}, false);
              }),
              HasSubstr("forward: sequence 0 was made by another engine"));
  other->forward({theirs[0].get()}, {{1, 2}}, false);
  const auto snap = other->snapshot(*theirs[0], 0);
  EXPECT_THAT(k3test::error_of([&] { f.e->restore(*seqs[0], {snap.get()}); }), HasSubstr("another engine's"));
  EXPECT_THAT(k3test::error_of([&] { f.e->reset(*theirs[0]); }), HasSubstr("reset was made by another engine"));
  ForwardHooks tensors;
  tensors.tensor = [](const char*, int64_t, const float*, int64_t, int64_t) {};
  EXPECT_THAT(k3test::error_of([&] {
                f.e->forward({seqs[0].get()}, {{1, 2}}, false, &tensors);
              }),
              HasSubstr("no per-block tensor hooks"));
  EXPECT_THAT(k3test::error_of([&] { f.e->forward({seqs[0].get()}, {{int32_t(f.c.vocab_size)}}, false); }),
              HasSubstr(std::to_string(f.c.vocab_size)));
  EXPECT_THAT(k3test::error_of([&] {
                Engine::load(fixture("k3-tiny-a"), {Device::CUDA, Precision::F64});
              }),
              HasSubstr("CPU only"));
  EXPECT_THAT(k3test::error_of([] { parse_precision("f16", "--precision"); }), HasSubstr("f32, bf16 or f64"));
  const std::unique_ptr<Engine> loaded = Engine::load(fixture("k3-tiny-a"), {Device::CPU, Precision::F64});
  EXPECT_EQ(loaded->description(), "cpu (f64)");
}
