// Training checkpoints: a Hugging Face model directory the inference engine loads, plus the exact
// training state, written so that a kill at any moment leaves the previous checkpoint intact.
//
// Layout under the run directory OUT:
//   OUT/step-00000100/config.json        the model config (as given to training)
//   OUT/step-00000100/model.safetensors  every parameter under its release name, F32 (the router's
//                                        e_score_correction_bias holds the balancer's current bias)
//   OUT/step-00000100/train_state.bin    float64 parameters, optimizer and balancer state, the data
//                                        position and step: everything `--resume` needs to continue
//                                        with identical losses
//   OUT/step-00000100/tiktoken.model     (SFT runs) the tokenizer, with tokenizer_config.json if it has one
//   OUT/latest                           the name of the newest complete step directory
// A step directory is written as OUT/.tmp-step-..., fsynced, then renamed into place, and only
// then is `latest` replaced (atomically). A kill before the rename leaves a .tmp directory, which
// is ignored and removed by the next save.
#pragma once
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "model/params.h"

namespace k3::train {

struct TrainState {
  nlohmann::json meta;                         // step, data position, options... (caller's keys)
  std::vector<double> optimizer;               // flat optimizer state
  std::vector<std::vector<double>> balancers;  // flat state of each layer's balancer
};

// Writes OUT/step-<step>/ and points OUT/latest at it. Returns the step directory. `extra_files` are copied into
// it under their own names (an SFT run's tokenizer, so that its checkpoints chat as they are).
std::string save_checkpoint(const std::string& out_dir, int64_t step, const std::string& config_json,
                            const ParamStore& P, const TrainState& state,
                            const std::vector<std::string>& extra_files = {});

// A model directory of P's values (config.json, F32 model.safetensors, `extra_files` copied in) at `dir`, written
// beside it and renamed into place (what stood there before is replaced): the policy an RL run's rollout engine
// loads after each update.
void write_model_dir(const std::string& dir, const std::string& config_json, const ParamStore& P,
                     const std::vector<std::string>& extra_files = {});

// The step directory OUT/latest names ("" when there is none).
// The directory name of step N's checkpoint inside a run directory ("step-00000042").
std::string step_name(int64_t step);
std::string latest_checkpoint(const std::string& out_dir);

// Reads a step directory's train_state.bin: the parameters into P (names and sizes must match P's)
// and the rest into `state`. Errors name the file.
void load_checkpoint(const std::string& step_dir, ParamStore& P, TrainState& state);

}  // namespace k3::train
