#include "multimodal/media_prompt.h"

#include <cstring>

#include "core/base64.h"
#include "core/error.h"
#include "media/image_decode.h"
#include "media/vision_preprocess.h"
#include "model/vision.h"
#include "tokenizer/tokenizer.h"

namespace k3 {

namespace {

using ojson = nlohmann::ordered_json;

// A data URL's base64 payload: padding only at its end, no group of a lone character.
std::vector<uint8_t> data_url_base64(std::string_view s, const std::string& what) {
  while (!s.empty() && s.back() == '=') s.remove_suffix(1);
  std::string bytes;
  size_t bad = s.find('=');
  if (bad != std::string_view::npos || !base64_decode(s, bytes, &bad))
    fail(what, ": the data URL's base64 has '", std::string(1, s[bad]), "' at byte ", bad, " of its payload");
  if (s.size() % 4 == 1) fail(what, ": the data URL's base64 payload is cut (", s.size(), " characters)");
  return std::vector<uint8_t>(bytes.begin(), bytes.end());
}

int hex_value(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

// The URL of an image part: image_url.url, image_url (a string), or image (a string).
std::string image_url(const ChatImagePart& p) {
  const ojson& part = p.part;
  for (const char* key : {"image_url", "image"}) {
    if (!part.contains(key)) continue;
    const ojson& v = part[key];
    if (v.is_string()) return v.get<std::string>();
    if (v.is_object() && v.contains("url") && v["url"].is_string()) return v["url"].get<std::string>();
    fail("chat request: ", p.field, ".", key, " must be a URL string or an object with a string 'url'");
  }
  fail("chat request: ", p.field, " (an image part) has no 'image_url'");
}

}  // namespace

MediaProcConfig media_proc_config(const VisionConfig& c) {
  K3_CHECK(c.merge_h == c.merge_w, c.source, ": the processor merges square neighbourhoods, the tower ", c.merge_h,
           " x ", c.merge_w);
  MediaProcConfig cfg;
  cfg.patch_size = c.patch_size;
  cfg.merge_kernel_size = c.merge_h;
  return cfg;
}

std::vector<uint8_t> data_url_bytes(const std::string& url, const std::string& what) {
  K3_CHECK(url.rfind("data:", 0) == 0, what, ": not a data URL");
  const size_t comma = url.find(',');
  if (comma == std::string::npos) fail(what, ": the data URL has no ',' before its payload");
  const std::string_view meta(url.data() + 5, comma - 5), payload(url.data() + comma + 1, url.size() - comma - 1);
  if (meta.size() >= 7 && meta.substr(meta.size() - 7) == ";base64") return data_url_base64(payload, what);
  std::vector<uint8_t> out;  // percent-encoded
  for (size_t i = 0; i < payload.size(); ++i) {
    if (payload[i] != '%') {
      out.push_back(uint8_t(payload[i]));
      continue;
    }
    const int hi = i + 2 < payload.size() ? hex_value(payload[i + 1]) : -1;
    const int lo = i + 2 < payload.size() ? hex_value(payload[i + 2]) : -1;
    if (hi < 0 || lo < 0) fail(what, ": the data URL has a bad percent escape at byte ", i, " of its payload");
    out.push_back(uint8_t(hi * 16 + lo));
    i += 2;
  }
  return out;
}

std::vector<Image8> load_chat_images(const std::vector<ChatImagePart>& parts, const MediaSources& sources) {
  std::vector<Image8> out;
  for (const ChatImagePart& p : parts) {
    const std::string url = image_url(p);
    if (url.rfind("data:", 0) == 0) {
      const std::vector<uint8_t> bytes = data_url_bytes(url, "chat request: " + p.field);
      out.push_back(decode_image(bytes.data(), bytes.size(), "chat request: " + p.field));
      continue;
    }
    const bool file_url = url.rfind("file://", 0) == 0;
    if (url.find("://") != std::string::npos && !file_url)
      fail("chat request: ", p.field, ": only data URLs", sources.allow_files ? " and files" : "",
           " are taken (no network access): '", url.substr(0, 64), "'");
    if (!sources.allow_files)
      fail("chat request: ", p.field, ": this server takes images as data URLs (data:image/png;base64,...), not files");
    out.push_back(read_image_file(file_url ? url.substr(7) : url));
  }
  return out;
}

std::vector<ChatSegment> with_media_prompts(const std::vector<ChatSegment>& segments,
                                            const std::vector<Image8>& images) {
  std::vector<ChatSegment> out;
  size_t k = 0;
  for (const ChatSegment& s : segments) {
    if (!(s.special && s.text == kXtmlImagePlaceholder)) {
      out.push_back(s);
      continue;
    }
    K3_CHECK(k < images.size(), "chat request: more image placeholders than the ", images.size(), " images given");
    const Image8& im = images[k++];
    out.push_back({"<|media_begin|>", true});
    out.push_back({"image " + std::to_string(im.width) + "x" + std::to_string(im.height), false});
    out.push_back({"<|media_content|>", true});
    out.push_back({"<|media_pad|>", true});
    out.push_back({"<|media_end|>", true});
  }
  K3_CHECK(k == images.size(), "chat request: ", images.size(), " images for ", k, " image placeholders");
  return out;
}

MediaPrompt encode_media_prompt(const Tokenizer& tok, const VisionEncoder* vision, int64_t text_hidden,
                                const std::vector<ChatSegment>& segments, const std::vector<Image8>& images) {
  MediaPrompt p;
  const std::vector<int32_t> ids = encode_segments(tok, with_media_prompts(segments, images));
  if (images.empty()) {
    p.ids = ids;
    return p;
  }
  if (!vision) fail("chat request: this model has no vision tower (no vision_config in its config.json)");
  const VisionConfig& vc = vision->config();
  K3_CHECK(vc.text_hidden_size == text_hidden, vc.source, ": the projector writes ", vc.text_hidden_size,
           " values a token, the text model's hidden size is ", text_hidden);
  const MediaProcConfig cfg = media_proc_config(vc);
  std::vector<float> pixels;
  std::vector<VisionGrid> grids;
  for (const Image8& im : images) {
    const VisionInput v = preprocess_image(im, cfg);
    pixels.insert(pixels.end(), v.patches.begin(), v.patches.end());
    grids.push_back({1, v.grid_h, v.grid_w});
  }
  const int64_t L = int64_t(pixels.size()) / (3 * vc.patch_size * vc.patch_size);
  vision->check_grids(grids, L);
  std::vector<VisionItem> items = vision->encode(pixels.data(), L, grids);
  for (VisionItem& it : items) p.features.push_back(std::move(it.projected));
  const int32_t pad = tok.special_id("<|media_pad|>");
  size_t k = 0;
  for (int32_t id : ids) {
    if (id != pad) {
      p.ids.push_back(id);
      continue;
    }
    K3_CHECK(k < items.size(), "chat request: more <|media_pad|> ids than images");
    const int64_t n = items[k].tokens;
    p.rows.push_back(InputRows{int64_t(p.ids.size()), n, p.features[k].data()});
    p.ids.insert(p.ids.end(), size_t(n), pad);
    ++k;
  }
  K3_CHECK(k == items.size(), "chat request: ", items.size(), " images for ", k, " <|media_pad|> ids");
  return p;
}

}  // namespace k3
