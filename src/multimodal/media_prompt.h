// Images in a chat prompt, as Moonshot's processor and model take them (K3-ARCHITECTURE.md §8, steps 6 and 1):
// each image part of a request's messages renders as
//   <|media_begin|>image {W}x{H}<|media_content|><|media_pad|><|media_end|>
// (W x H the original image's size), and the one <|media_pad|> stands, in the embedding sequence, for the image's
// N projected tokens. Here the ids hold N copies of <|media_pad|> in its place, so that positions, caches and
// usage count what the model sees, and the projected rows go in as the forward's input rows at those positions
// (model/layers.h, InputRows).
//
// An image part is {"type": "image_url", "image_url": {"url": URL}} (or "image_url": URL), or {"type": "image",
// "image": URL}; URL is a data URL (data:image/png;base64,...) or, where the caller allows files, a path or a
// file:// URL. PNG and JPEG (media/image_decode.h).
#pragma once
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "media/image.h"
#include "media/vision_preprocess.h"
#include "model/layers.h"
#include "model/vision_config.h"
#include "tokenizer/xtml_chat.h"

namespace k3 {

class Tokenizer;
class VisionEncoder;

struct MediaSources {
  bool allow_files = false;  // paths and file:// URLs (the CLI); a server takes data URLs only
};

// The image parts render_chat met, decoded. A k3::Error names the part (messages[i].content[j]) for a URL it cannot
// take or an image it cannot decode.
std::vector<Image8> load_chat_images(const std::vector<ChatImagePart>& parts, const MediaSources& sources);

// The processor's settings for a tower: the release's media_proc_cfg with the tower's patch size and merge.
MediaProcConfig media_proc_config(const VisionConfig& c);

// Bytes of a data URL's payload (base64 or percent-encoded); `what` names it in errors.
std::vector<uint8_t> data_url_bytes(const std::string& url, const std::string& what);

// A prompt with its images: ids (each <|media_pad|> repeated once per projected token) and the rows that go in at
// those positions, which point into `features` (keep the MediaPrompt alive while they are used).
struct MediaPrompt {
  std::vector<int32_t> ids;
  std::vector<InputRows> rows;
  std::vector<std::vector<float>> features;  // per image [tokens, text hidden]
  int64_t first_row() const { return rows.empty() ? int64_t(ids.size()) : rows.front().at; }
};

// segments (render_chat's, one image placeholder per image in order) with each placeholder replaced by the media
// prompt of its image; a k3::Error when the counts differ.
std::vector<ChatSegment> with_media_prompts(const std::vector<ChatSegment>& segments,
                                            const std::vector<Image8>& images);

// The ids of segments (with_media_prompts') and each image run through the processor's preprocessing and the
// vision tower and projector (on vision's device: the CPU, or the GPU in bf16). `vision` may be null only when there are no images (a k3::Error says the
// model has no vision tower otherwise).
MediaPrompt encode_media_prompt(const Tokenizer& tok, const VisionEncoder* vision, int64_t text_hidden,
                                const std::vector<ChatSegment>& segments, const std::vector<Image8>& images);

}  // namespace k3
