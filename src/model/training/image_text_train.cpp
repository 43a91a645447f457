#include "model/training/image_text_train.h"

#include "core/error.h"
#include "model/training/model_train.h"
#include "model/training/vision_train.h"

namespace k3::train {

ImageTextLoss image_text_loss(ParamStore& P, const K3Config& c, const VisionConfig& vc, const ImageTextSequence& s,
                              bool backward, double grad_scale) {
  K3_CHECK(vc.text_hidden_size == c.hidden_size, "image-text training: the projector writes ", vc.text_hidden_size,
           " values a token (", vc.source, "), and the text model's hidden_size is ", c.hidden_size);
  K3_CHECK(s.image_at.size() == s.grids.size(), "image-text training: ", s.image_at.size(), " image positions for ",
           s.grids.size(), " images");
  const int64_t V = vc.patch_values(), H = c.hidden_size;
  K3_CHECK(int64_t(s.pixel_patches.size()) % V == 0, "image-text training: ", s.pixel_patches.size(),
           " pixel values are not whole patches of ", V);
  const VisionTape tape = vision_forward(P, vc, s.pixel_patches.data(), int64_t(s.pixel_patches.size()) / V, s.grids);

  std::vector<TrainInputRows> rows;
  std::vector<std::vector<double>> drows(tape.items.size());
  for (size_t i = 0; i < tape.items.size(); ++i) {
    const VisionItemTape& it = tape.items[i];
    K3_CHECK(s.image_at[i] >= 0 && s.image_at[i] + it.tokens <= int64_t(s.ids.size()), "image-text training: image ", i,
             "'s ", it.tokens, " tokens from position ", s.image_at[i], " do not fit a sequence of ", s.ids.size(),
             " ids");
    if (backward) drows[i].resize(size_t(it.tokens * H));
    rows.push_back({s.image_at[i], it.tokens, it.projected.data(), backward ? drows[i].data() : nullptr});
  }
  ImageTextLoss out;
  out.loss = sequence_loss(P, c, s.ids, rows, backward, grad_scale);
  out.targets = target_count(int64_t(s.ids.size()), rows);
  if (backward) {
    VisionOutputGrads d;
    for (const std::vector<double>& g : drows) d.projected.push_back(g.data());
    vision_backward(P, vc, tape, d);
  }
  return out;
}

}  // namespace k3::train
