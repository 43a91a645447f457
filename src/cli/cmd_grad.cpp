// k3 grad: the loss of rows of token ids and its gradient for every parameter (float64 training
// forward and backward), written as a safetensors file.
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <memory>

#include "cli/args.h"
#include "cli/commands.h"
#include "core/error.h"
#include "core/finite.h"
#include "io/safetensors.h"
#include "model/config.h"
#include "model/params.h"
#include "model/training/model_train.h"

namespace k3::cli {

void register_grad(CLI::App& app) {
  struct Opts {
    std::string model, out;
    std::vector<std::string> ids;
  };
  auto o = std::make_shared<Opts>();
  CLI::App* sub = app.add_subcommand(
      "grad",
      "Mean next-token cross-entropy over rows of token ids (each row a sequence; position t predicts\n"
      "token t+1) and its gradient for every trained parameter, computed in float64 by the explicit\n"
      "backward of every K3 block. Writes OUT (safetensors, atomically): `loss` F32 [1] and\n"
      "`grad.<tensor name>` F32 under each parameter's own name and shape.");
  sub->add_option("--model", o->model, "model directory (config.json + safetensors; BF16/F32 weights)")->required();
  sub->add_option("--ids", o->ids, "a row of comma-separated token ids (repeat for more rows)")->required();
  sub->add_option("--out", o->out, "output safetensors file")->required();
  sub->callback([o] {
    std::vector<std::vector<int32_t>> rows;
    int64_t count = 0;
    for (const std::string& r : o->ids) {
      rows.push_back(parse_ids(r, "--ids"));
      if (rows.back().size() < 2)
        fail("--ids: a row needs at least 2 tokens (one prediction), got ", rows.back().size());
      count += int64_t(rows.back().size()) - 1;
    }
    check_output_path(o->out);
    std::fprintf(stderr, "[%.2fs] loading %s\n", elapsed_seconds(), o->model.c_str());
    const K3Config c = load_config((std::filesystem::path(o->model) / "config.json").string());
    train::ParamStore P = train::ParamStore::from_model_dir(o->model);
    check_ids_in_vocab(rows, c.vocab_size, "--ids", c.source);
    double loss = 0.0;
    for (size_t b = 0; b < rows.size(); ++b) {
      loss += train::sequence_loss(P, c, rows[b], /*backward=*/true, 1.0 / double(count));
      std::fprintf(stderr, "[%.2fs] row %zu/%zu done\n", elapsed_seconds(), b + 1, rows.size());
    }
    loss /= double(count);
    const std::vector<std::string> names = train::trainable_names(P);
    // The parameters are finite (ParamStore checks them at load), so a non-finite loss or gradient
    // was made by the arithmetic: name the first block output that went non-finite, then the first
    // gradient.
    for (size_t b = 0; b < rows.size() && !std::isfinite(loss); ++b) {
      std::string where;
      train::TrainHooks h;
      h.tensor = [&](const char* name, int64_t l, const double* d, int64_t r, int64_t cols) {
        if (const int64_t i = first_nonfinite(d, r * cols); where.empty() && i >= 0)
          where = "layer " + std::to_string(l) + "'s " + name + " (" + nonfinite_name(d[i]) + " at token " +
                  std::to_string(i / cols) + ")";
      };
      train::sequence_loss(P, c, rows[b], /*backward=*/false, 1.0, nullptr, &h);
      if (!where.empty())
        fail("the loss is ", nonfinite_name(loss), ": row ", b, " first goes non-finite in ", where,
             "; every weight of ", o->model, " is finite, so the values overflowed in the arithmetic");
    }
    if (!std::isfinite(loss)) fail("the loss is ", nonfinite_name(loss), " (every weight of ", o->model, " is finite)");
    if (const std::string bad = train::first_nonfinite_tensor(P, /*gradients=*/true); !bad.empty())
      fail("the gradient of ", bad, " is not finite (the loss, ", loss, ", is)");
    std::vector<std::vector<float>> grads;
    grads.reserve(names.size());
    std::vector<TensorToWrite> out;
    const float loss_f = float(loss);
    out.push_back({"loss", DType::F32, {1}, &loss_f});
    for (const std::string& n : names) {
      const double* g = P.g(n);
      grads.emplace_back(g, g + P.numel(n));
      out.push_back({"grad." + n, DType::F32, P.shape(n), grads.back().data()});
    }
    write_safetensors(o->out, out);
    std::printf("loss %.9g over %lld predictions in %zu rows; %zu gradients written to %s\n", loss, (long long)count,
                rows.size(), names.size(), o->out.c_str());
  });
}

}  // namespace k3::cli
