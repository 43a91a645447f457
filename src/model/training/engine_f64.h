// The float64 engine: the training model's float64 forward (model_train.h, sequence_decode) behind the Engine
// interface, each sequence continuing from its own float64 state (KDA conv tails and recurrent state, MLA keys
// and values in the expanded form).
//
// What it is for: a sampler whose numbers are the float64 trainer's. An RL run's rollouts on it
// (`k3 rl --rollout-precision f64`) have behaviour log-probabilities that equal the CPU trainer's recomputed ones
// to rounding (~1e-14), where the f32 engine's differ by up to ~|logit| * 1e-7, a few 1e-6 on a trained model
// (fp32 activations). It is also the float64 reference of every command that takes `--precision`.
//
// It runs on the CPU one sequence after another, with the training blocks' plain loops (the recurrence token by
// token): several times slower than the f32 engine, and meant for small models.
#pragma once
#include <memory>

#include "model/engine.h"
#include "model/params.h"

namespace k3 {

// An engine over the parameters P (config c), which it reads at every forward: a trainer that updates P in place
// updates the engine too. P must outlive the engine.
std::unique_ptr<Engine> float64_engine(std::shared_ptr<const train::ParamStore> P, const K3Config& c);

}  // namespace k3
