// Images in chat prompts (multimodal/media_prompt.h):
//   - data URLs decode (base64 with and without padding, the URL-safe alphabet, percent escapes); bad ones are
//     errors naming the part;
//   - render_chat reports image parts in placeholder order; with_media_prompts replaces each placeholder by
//     <|media_begin|>image WxH<|media_content|><|media_pad|><|media_end|> with the original size, as Moonshot's
//     processor writes it;
//   - load_chat_images takes data URLs, and files only where allowed; remote URLs never;
//   - encode_media_prompt repeats each image's <|media_pad|> once per projected token, and its rows are exactly
//     what the processor and the vision tower give for that image (preprocess_image + VisionModel::encode called
//     here directly), at those positions;
//   - end to end on `k3 init`'s k3-tiny-vision (text and tower in one directory): `k3 generate --image` feeds the
//     image's tokens; a chat request with the image as a data URL gets the same reply, log-probabilities included,
//     from a server whose prompt chunks cut the image's rows and from one that reads the prompt in one forward;
//     usage counts the image's tokens; another image changes the log-probabilities; a server whose model has no
//     tower, a bad data URL and a file path get 400s naming messages.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/error.h"
#include "io/file.h"
#include "media/image_decode.h"
#include "media/vision_preprocess.h"
#include "model/vision.h"
#include "multimodal/media_prompt.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer/xtml_chat.h"
#include "util/cli.h"
#include "util/compare.h"
#include "util/temp_dir.h"
#if defined(K3_HAVE_SERVE)
#include "util/serve_test.h"
#endif

using namespace k3;
using json = nlohmann::ordered_json;
#if defined(K3_HAVE_SERVE)
namespace sv = k3::serve;
#endif
using k3test::fixture;

namespace {

std::string base64(const std::vector<uint8_t>& b, bool pad = true) {
  static const char* a = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string out;
  size_t i = 0;
  for (; i + 2 < b.size(); i += 3) {
    const uint32_t v = uint32_t(b[i]) << 16 | uint32_t(b[i + 1]) << 8 | b[i + 2];
    for (int k = 3; k >= 0; --k) out += a[(v >> (6 * k)) & 63];
  }
  if (i + 1 == b.size()) {
    const uint32_t v = uint32_t(b[i]) << 16;
    out += a[(v >> 18) & 63], out += a[(v >> 12) & 63];
    if (pad) out += "==";
  } else if (i + 2 == b.size()) {
    const uint32_t v = uint32_t(b[i]) << 16 | uint32_t(b[i + 1]) << 8;
    out += a[(v >> 18) & 63], out += a[(v >> 12) & 63], out += a[(v >> 6) & 63];
    if (pad) out += "=";
  }
  return out;
}

std::vector<uint8_t> file_bytes(const std::string& path) {
  const std::string s = read_file(path);
  return std::vector<uint8_t>(s.begin(), s.end());
}

json chat_with(const std::vector<std::string>& urls, const std::string& text) {
  json parts = json::array();
  for (const std::string& u : urls) parts.push_back({{"type", "image_url"}, {"image_url", {{"url", u}}}});
  parts.push_back({{"type", "text"}, {"text", text}});
  return json{{"messages", {{{"role", "user"}, {"content", parts}}}}};
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

}  // namespace

TEST(MediaPrompt, DataUrlsDecode) {
  const std::vector<uint8_t> bytes = {0, 1, 2, 250, 251, 252, 253, 62, 63};
  for (size_t n = 0; n <= bytes.size(); ++n) {
    const std::vector<uint8_t> b(bytes.begin(), bytes.begin() + std::ptrdiff_t(n));
    EXPECT_EQ(data_url_bytes("data:image/png;base64," + base64(b), "x"), b) << n;
    EXPECT_EQ(data_url_bytes("data:image/png;base64," + base64(b, false), "x"), b) << n << " unpadded";
  }
  std::string url_safe = base64({251, 255, 191});
  std::replace(url_safe.begin(), url_safe.end(), '+', '-');
  std::replace(url_safe.begin(), url_safe.end(), '/', '_');
  EXPECT_EQ(data_url_bytes("data:;base64," + url_safe, "x"), (std::vector<uint8_t>{251, 255, 191}));
  EXPECT_EQ(data_url_bytes("data:text/plain,a%20b%FF", "x"), (std::vector<uint8_t>{'a', ' ', 'b', 255}));
  EXPECT_NE(error_of([] { data_url_bytes("data:image/png;base64,AB*D", "part 3"); }).find("part 3"), std::string::npos);
  EXPECT_NE(error_of([] { data_url_bytes("data:image/png;base64", "p"); }).find("no ','"), std::string::npos);
  EXPECT_NE(error_of([] { data_url_bytes("data:,%G1", "p"); }).find("percent escape"), std::string::npos);
}

TEST(MediaPrompt, PlaceholdersBecomeTheProcessorsMediaPrompt) {
  const std::string png = fixture("image-decode/png_RGB_64x48.png"), jpg = fixture("image-decode/jpeg_L_333x77.jpg");
  std::vector<ChatImagePart> parts;
  const std::vector<ChatSegment> segs = render_chat(chat_with({png, jpg}, "What is this?"), &parts);
  ASSERT_EQ(parts.size(), 2u);
  EXPECT_EQ(parts[1].field, "messages[0].content[1]");
  const std::vector<Image8> images = load_chat_images(parts, MediaSources{true});
  ASSERT_EQ(images.size(), 2u);
  EXPECT_EQ(images[1].width, 333);
  const std::string text = join_segments(with_media_prompts(segs, images));
  EXPECT_NE(text.find("<|media_begin|>image 64x48<|media_content|><|media_pad|><|media_end|>"
                      "<|media_begin|>image 333x77<|media_content|><|media_pad|><|media_end|>What is this?"),
            std::string::npos)
      << text;
  EXPECT_EQ(text.find(kXtmlImagePlaceholder), std::string::npos);
  EXPECT_THROW(with_media_prompts(segs, {images[0]}), Error);
}

TEST(MediaPrompt, ImagesComeFromDataUrlsAndAllowedFilesOnly) {
  const std::string png = fixture("image-decode/png_RGBA_5x3.png");
  const std::string url = "data:image/png;base64," + base64(file_bytes(png));
  std::vector<ChatImagePart> parts;
  render_chat(chat_with({url}, "hi"), &parts);
  const std::vector<Image8> from_url = load_chat_images(parts, MediaSources{});
  const Image8 from_file = read_image_file(png);
  ASSERT_EQ(from_url.size(), 1u);
  EXPECT_EQ(from_url[0].pixels, from_file.pixels);
  parts.clear();
  render_chat(chat_with({png}, "hi"), &parts);
  EXPECT_NE(error_of([&] { load_chat_images(parts, MediaSources{}); }).find("messages[0].content[0]"),
            std::string::npos);
  EXPECT_EQ(load_chat_images(parts, MediaSources{true})[0].pixels, from_file.pixels);
  parts.clear();
  render_chat(chat_with({"https://example.com/cat.png"}, "hi"), &parts);
  EXPECT_NE(error_of([&] { load_chat_images(parts, MediaSources{true}); }).find("no network access"),
            std::string::npos);
  parts.clear();
  render_chat(chat_with({"data:image/png;base64," + base64({1, 2, 3, 4})}, "hi"), &parts);
  EXPECT_NE(error_of([&] { load_chat_images(parts, MediaSources{}); }).find("messages[0].content[0]"),
            std::string::npos);
}

TEST(MediaPrompt, PadsRepeatOncePerProjectedTokenAndRowsAreTheTowers) {
  k3test::TempDir dir("media-prompt");
  k3test::write_tiny_tokenizer(dir.path() / "tok");
  const Tokenizer tok = Tokenizer::load_dir(dir.file("tok"));
  const std::unique_ptr<VisionModel> vision = VisionModel::load(fixture("vision-tiny"));
  const int64_t H = vision->config().text_hidden_size;
  const std::string png = fixture("image-decode/png_RGB_64x48.png"), jpg = fixture("image-decode/jpeg_L_333x77.jpg");
  std::vector<ChatImagePart> parts;
  const std::vector<ChatSegment> segs = render_chat(chat_with({png, jpg}, "What is this?"), &parts);
  const std::vector<Image8> images = load_chat_images(parts, MediaSources{true});
  const MediaPrompt mp = encode_media_prompt(tok, vision.get(), H, segs, images);
  // The truth: the segments' ids with each pad repeated, and the tower's output for each image alone.
  const std::vector<int32_t> plain = encode_segments(tok, with_media_prompts(segs, images));
  const int32_t pad = tok.special_id("<|media_pad|>");
  ASSERT_EQ(mp.rows.size(), 2u);
  std::vector<int32_t> want;
  size_t k = 0;
  for (int32_t id : plain) {
    if (id != pad) {
      want.push_back(id);
      continue;
    }
    const VisionInput v = preprocess_image(images[k], media_proc_config(vision->config()));
    const std::vector<VisionItem> item =
        vision->encode(v.patches.data(), v.grid_h * v.grid_w, {VisionGrid{1, v.grid_h, v.grid_w}});
    const InputRows& r = mp.rows[k];
    EXPECT_EQ(r.at, int64_t(want.size())) << "image " << k;
    EXPECT_EQ(r.n, item[0].tokens) << "image " << k;
    EXPECT_EQ(r.n, plan_resize(images[k].width, images[k].height, media_proc_config(vision->config())).tokens);
    EXPECT_EQ(0, std::memcmp(r.data, item[0].projected.data(), size_t(r.n * H) * sizeof(float))) << "image " << k;
    want.insert(want.end(), size_t(r.n), pad);
    ++k;
  }
  EXPECT_EQ(mp.ids, want);
  EXPECT_EQ(mp.first_row(), mp.rows[0].at);
  EXPECT_NE(error_of([&] { encode_media_prompt(tok, nullptr, H, segs, images); }).find("no vision tower"),
            std::string::npos);
  EXPECT_NE(error_of([&] { encode_media_prompt(tok, vision.get(), H + 1, segs, images); }).find("hidden size"),
            std::string::npos);
  // Without images: the plain ids, no rows.
  const std::vector<ChatSegment> text_only = render_chat(chat_with({}, "hello"));
  const MediaPrompt none = encode_media_prompt(tok, nullptr, H, text_only, {});
  EXPECT_EQ(none.ids, encode_segments(tok, text_only));
  EXPECT_TRUE(none.rows.empty());
}

#if defined(K3_HAVE_SERVE)
namespace {

// k3-tiny-vision made by `k3 init` (text model and tower in one directory) and a tokenizer of its 3,840 ranks.
struct VisionModelDir {
  k3test::TempDir dir{"media-prompt-e2e"};
  std::string model = dir.file("m"), tok = dir.file("tok");
  VisionModelDir() {
    const k3test::Outcome init = k3test::run_k3(
        {"init", "--config", std::string(K3_SOURCE_DIR) + "/configs/k3-tiny-vision.json", "--out", model});
    EXPECT_EQ(init.status, 0) << init.output;
    std::filesystem::create_directories(tok);
    std::ifstream in(fixture("tokenizer/o200k.tiktoken"));
    std::ofstream out(tok + "/tiktoken.model");
    std::string line;
    for (int i = 0; i < 3840 && std::getline(in, line); ++i) out << line << "\n";
  }
};

json post_chat(const k3test::ServeOnLoopback& s, const json& body, int* status) {
  auto r = s.client().Post("/v1/chat/completions", body.dump(), "application/json");
  *status = r ? r->status : -1;
  return r ? json::parse(r->body, nullptr, false) : json();
}

}  // namespace

TEST(MediaPrompt, ImagesReachTheModelThroughTheCliAndTheServer) {
  VisionModelDir d;
  const std::string png = fixture("image-decode/png_RGB_64x48.png");
  const std::unique_ptr<VisionModel> vision = VisionModel::load(d.model);
  const int64_t n = plan_resize(64, 48, media_proc_config(vision->config())).tokens;
  const k3test::Outcome cli = k3test::run_k3({"generate", "--model", d.model, "--tokenizer", d.tok, "--prompt",
                                              "What is this?", "--image", png, "--max-new-tokens", "6"});
  ASSERT_EQ(cli.status, 0) << cli.output;
  EXPECT_NE(cli.output.find("1 image(s): " + std::to_string(n) + " prompt tokens from the vision tower"),
            std::string::npos)
      << cli.output;
  EXPECT_NE(cli.output.find("message: "), std::string::npos) << cli.output;

  // Two servers: the prompt in chunks of 5 (one cuts the image's rows) and in one forward. On the CPU a
  // sequence's rows do not depend on how its prompt was cut, so both give the same reply, to the log-probability.
  sv::ServeOptions chunked, whole;
  chunked.prefill_chunk = 5;  // (any 6 positions hold a chunk boundary: the image's rows are cut)
  k3test::ServeOnLoopback a(Engine::load(d.model, EngineOptions{}), d.tok, chunked, VisionModel::load(d.model));
  k3test::ServeOnLoopback b(Engine::load(d.model, EngineOptions{}), d.tok, whole, VisionModel::load(d.model));
  const std::string url = "data:image/png;base64," + base64(file_bytes(png));
  auto body = [&](const std::vector<std::string>& urls) {
    json q = chat_with(urls, "What is this?");
    q["temperature"] = 0;
    q["max_tokens"] = 6;
    q["logprobs"] = true;
    q["top_logprobs"] = 3;
    return q;
  };
  int status = 0;
  const json ra = post_chat(a, body({url}), &status);
  ASSERT_EQ(status, 200) << ra.dump();
  const json rb = post_chat(b, body({url}), &status);
  ASSERT_EQ(status, 200) << rb.dump();
  EXPECT_EQ(ra["choices"][0]["message"], rb["choices"][0]["message"]);
  EXPECT_EQ(ra["choices"][0]["logprobs"], rb["choices"][0]["logprobs"]);
  EXPECT_EQ(ra["usage"], rb["usage"]);
  // The prompt counts the image's tokens: <|media_begin|>, "image 64x48", <|media_content|>, n pads, <|media_end|>.
  const json text_only = post_chat(a, body({}), &status);
  ASSERT_EQ(status, 200) << text_only.dump();
  const Tokenizer tok = Tokenizer::load_dir(d.tok);
  const int64_t media = 3 + int64_t(tok.encode("image 64x48", false).size()) + n;
  EXPECT_EQ(ra["usage"]["prompt_tokens"].get<int64_t>() - text_only["usage"]["prompt_tokens"].get<int64_t>(), media);
  // Another image, same text: other log-probabilities.
  const std::string other = "data:image/png;base64," + base64(file_bytes(fixture("image-decode/png_L_64x48.png")));
  const json ro = post_chat(a, body({other}), &status);
  ASSERT_EQ(status, 200) << ro.dump();
  EXPECT_NE(ro["choices"][0]["logprobs"], ra["choices"][0]["logprobs"]);
  // Refusals: a file path, a bad data URL (400s naming messages).
  for (const std::string& bad : {png, std::string("data:image/png;base64,AAAA")}) {
    const json e = post_chat(a, body({bad}), &status);
    EXPECT_EQ(status, 400) << bad << ": " << e.dump();
    EXPECT_EQ(e["error"]["param"], "messages") << e.dump();
  }
}

TEST(MediaPrompt, AModelWithoutATowerRefusesImages) {
  k3test::TempDir dir("media-prompt-novision");
  sv::ServeOptions o;
  k3test::ServeOnLoopback server(k3test::write_tiny_tokenizer(dir), o);
  const std::string url = "data:image/png;base64," + base64(file_bytes(fixture("image-decode/png_RGB_5x3.png")));
  int status = 0;
  const json e = post_chat(server, chat_with({url}, "hi"), &status);
  EXPECT_EQ(status, 400) << e.dump();
  EXPECT_NE(e["error"]["message"].get<std::string>().find("no vision tower"), std::string::npos) << e.dump();
}
#endif  // K3_HAVE_SERVE
