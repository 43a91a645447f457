// Training on text with images (K3-ARCHITECTURE.md §8, step 6), float64 on the CPU: the vision tower and
// projector (vision_train.h) encode the images, their projected tokens go in as the text model's input rows
// (model_train.h: TrainInputRows) in place of the placeholder ids that hold their positions, and the text loss's
// gradient flows back through those rows into the tower, so one backward trains both.
#pragma once
#include <cstdint>
#include <vector>

#include "model/config.h"
#include "model/params.h"
#include "model/vision.h"
#include "model/vision_config.h"

namespace k3::train {

// One training sequence with its images, as inference lays a media prompt out (multimodal/media_prompt.h): the
// ids hold image i's projected tokens as placeholder ids (<|media_pad|>, repeated once per token) from
// image_at[i] on.
struct ImageTextSequence {
  std::vector<int32_t> ids;
  std::vector<double> pixel_patches;  // [patches, 3 p p]: every image's patches in (t, h, w) order, images in order
  std::vector<VisionGrid> grids;      // one per image
  std::vector<int64_t> image_at;      // one per image: its first token's position among ids
};

struct ImageTextLoss {
  double loss = 0;      // the summed next-token cross-entropy over the text targets
  int64_t targets = 0;  // how many positions it sums over (positions before an image token predict nothing)
};

// The loss of s under P's text model (c) and vision tower (vc, whose text_hidden_size must be c's hidden_size).
// With `backward`, the gradients of grad_scale * loss are ACCUMULATED into P: the text tensors and every vision
// tensor. A k3::Error names an image whose tokens do not fit among the ids, or the position where two overlap.
ImageTextLoss image_text_loss(ParamStore& P, const K3Config& c, const VisionConfig& vc, const ImageTextSequence& s,
                              bool backward, double grad_scale);

}  // namespace k3::train
