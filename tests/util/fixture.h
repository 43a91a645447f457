// The golden k3-tiny-a fixture, shared by the test files that use it: the goldens, the model
// (loaded once per test process) and the token-id rows stored as I64 [B, T] tensors.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "compare.h"
#include "io/safetensors.h"
#include "model/engine.h"
#include "model/model.h"

namespace k3test {

inline const k3::SafeTensors& golden() {
  static k3::SafeTensors g = k3::SafeTensors::open(fixture("k3-tiny-a/golden.safetensors"));
  return g;
}

inline k3::Model& tiny() {
  static std::unique_ptr<k3::Model> m =
      k3::Model::load(fixture("k3-tiny-a/config.json"), fixture("k3-tiny-a/model.safetensors"));
  return *m;
}

// An engine over a model that outlives it (the CPU engine's interface on a test's Model).
inline std::unique_ptr<k3::Engine> engine_of(k3::Model& m) {
  return k3::Engine::on_cpu(std::shared_ptr<k3::Model>(std::shared_ptr<k3::Model>(), &m));
}

// The engine over tiny().
inline k3::Engine& tiny_engine() {
  static std::unique_ptr<k3::Engine> e = engine_of(tiny());
  return *e;
}

// Every row of an I64 [B, T] golden tensor.
inline std::vector<std::vector<int32_t>> golden_rows(const std::string& name) {
  const k3::TensorView& t = golden().get(name);
  const std::vector<int64_t> ids = golden().read_i64(name);
  std::vector<std::vector<int32_t>> rows(static_cast<size_t>(t.shape[0]));
  for (int64_t b = 0; b < t.shape[0]; ++b)
    for (int64_t i = 0; i < t.shape[1]; ++i) rows[size_t(b)].push_back(int32_t(ids[size_t(b * t.shape[1] + i)]));
  return rows;
}

// Row b of an I64 [B, T] golden tensor.
inline std::vector<int32_t> golden_row(const std::string& name, int64_t b = 0) { return golden_rows(name)[size_t(b)]; }

}  // namespace k3test
