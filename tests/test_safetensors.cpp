// Tests of the safetensors reader (single file, sharded directory, hostile headers) and the
// atomic writer. Every bad input must throw k3::Error naming the file and the tensor or field.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"
#include "io/safetensors.h"
#include "util/error_of.h"
#include "util/temp_dir.h"

namespace fs = std::filesystem;
using json = nlohmann::json;
using k3::DType;
using k3::SafeTensors;
using k3::TensorToWrite;
using ::testing::AllOf;
using ::testing::HasSubstr;

namespace {

// A fresh directory per test (named after it), removed afterwards.
class TempDir : public k3test::TempDir {
 public:
  TempDir() : k3test::TempDir(test_tag()) {}

 private:
  static std::string test_tag() {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    return info ? std::string(info->test_suite_name()) + "_" + info->name() : "x";
  }
};

// Runs f, which must throw k3::Error; returns its message.
using k3test::error_of;

std::string open_error(const std::string& path) {
  return error_of([&] { SafeTensors::open(path); });
}

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  ASSERT_TRUE(out) << path;
  out.write(bytes.data(), std::streamsize(bytes.size()));
  ASSERT_TRUE(out) << path;
}

std::string le64(uint64_t v) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[size_t(i)] = char((v >> (8 * i)) & 0xff);
  return s;
}

// A hand-made safetensors file: 8-byte little-endian header length, header text, data.
std::string raw_file(const std::string& header, const std::string& data) { return le64(header.size()) + header + data; }

void write_raw(const std::string& path, const std::string& header, const std::string& data) {
  write_bytes(path, raw_file(header, data));
}

template <class T>
std::string bytes_of(const std::vector<T>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(T));
}

std::vector<std::string> dir_entries(const fs::path& dir) {
  std::vector<std::string> out;
  for (auto& e : fs::directory_iterator(dir)) out.push_back(e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

uint32_t f32_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// ---------------------------------------------------------------------------------------------
// Round trip

TEST(SafeTensorsRoundTrip, AllDtypesShapesAndMetadata) {
  TempDir dir;
  const std::string path = dir.file("model.safetensors");
  std::vector<float> f32 = {1.5f, -2.25f, 0.0f, 3.0e-8f, 1.0e30f, -0.0f};
  std::vector<uint16_t> bf16 = {0x3f80, 0xbf80, 0x4000, 0x0000};  // 1, -1, 2, 0
  std::vector<uint16_t> f16 = {0x3c00, 0xc000, 0x3800};           // 1, -2, 0.5
  std::vector<uint8_t> u8 = {0, 1, 127, 128, 255};
  std::vector<int64_t> i64 = {0, -1, std::numeric_limits<int64_t>::max(), std::numeric_limits<int64_t>::min()};
  std::map<std::string, std::string> meta = {{"format", "pt"}, {"note", "k3 test \"quoted\""}};
  k3::write_safetensors(path,
                        {{"a.f32", DType::F32, {2, 3}, f32.data()},
                         {"b.bf16", DType::BF16, {4}, bf16.data()},
                         {"c.f16", DType::F16, {1, 3, 1}, f16.data()},
                         {"d.u8", DType::U8, {5}, u8.data()},
                         {"e.i64", DType::I64, {2, 2}, i64.data()}},
                        meta);

  SafeTensors st = SafeTensors::open(path);
  EXPECT_EQ(st.path(), path);
  EXPECT_EQ(st.metadata(), meta);
  EXPECT_EQ(st.names(), (std::vector<std::string>{"a.f32", "b.bf16", "c.f16", "d.u8", "e.i64"}));
  EXPECT_TRUE(st.has("a.f32"));
  EXPECT_FALSE(st.has("zzz"));

  const auto& a = st.get("a.f32");
  EXPECT_EQ(a.name, "a.f32");
  EXPECT_EQ(a.dtype, DType::F32);
  EXPECT_EQ(a.shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(a.shape_str(), "[2, 3]");
  EXPECT_EQ(a.numel(), 6);
  EXPECT_EQ(a.nbytes, 24u);
  ASSERT_NE(a.file, nullptr);
  EXPECT_EQ(*a.file, path);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(a.data) % 4, 0u);
  std::vector<float> rf = st.read_f32("a.f32", {2, 3});
  ASSERT_EQ(rf.size(), f32.size());
  for (size_t i = 0; i < f32.size(); ++i) EXPECT_EQ(f32_bits(rf[i]), f32_bits(f32[i])) << i;

  EXPECT_EQ(st.get("b.bf16").dtype, DType::BF16);
  EXPECT_EQ(st.get("b.bf16").shape, (std::vector<int64_t>{4}));
  EXPECT_EQ(std::memcmp(st.get("b.bf16").data, bf16.data(), 8), 0);
  EXPECT_EQ(st.read_f32("b.bf16"), (std::vector<float>{1.0f, -1.0f, 2.0f, 0.0f}));

  EXPECT_EQ(st.get("c.f16").dtype, DType::F16);
  EXPECT_EQ(st.get("c.f16").shape, (std::vector<int64_t>{1, 3, 1}));
  EXPECT_EQ(st.read_f32("c.f16", {1, 3, 1}), (std::vector<float>{1.0f, -2.0f, 0.5f}));

  const auto& d = st.get("d.u8");
  EXPECT_EQ(d.dtype, DType::U8);
  EXPECT_EQ(d.shape, (std::vector<int64_t>{5}));
  ASSERT_EQ(d.nbytes, 5u);
  EXPECT_EQ(std::vector<uint8_t>(d.data, d.data + d.nbytes), u8);

  EXPECT_EQ(st.get("e.i64").dtype, DType::I64);
  EXPECT_EQ(st.get("e.i64").shape, (std::vector<int64_t>{2, 2}));
  EXPECT_EQ(st.read_i64("e.i64"), i64);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(st.get("e.i64").data) % 8, 0u);

  // Moving keeps the views (and their file-name pointers) valid.
  SafeTensors moved = std::move(st);
  EXPECT_EQ(*moved.get("e.i64").file, path);
  EXPECT_EQ(moved.read_i64("e.i64"), i64);
}

TEST(SafeTensorsRoundTrip, NoMetadataMeansEmptyMetadata) {
  TempDir dir;
  const std::string path = dir.file("m.safetensors");
  std::vector<float> v = {7.0f};
  k3::write_safetensors(path, {{"x", DType::F32, {1}, v.data()}});
  SafeTensors st = SafeTensors::open(path);
  EXPECT_TRUE(st.metadata().empty());
  EXPECT_EQ(st.read_f32("x"), v);
}

TEST(SafeTensorsRoundTrip, ReadF32WidensHalfPrecisionExactly) {
  TempDir dir;
  const std::string path = dir.file("half.safetensors");
  std::vector<uint16_t> bf16 = {0x3f80, 0x8000, 0x7f80, 0xff80, 0x0001, 0x3fc0, 0x4049};
  std::vector<uint16_t> f16 = {0x3c00, 0x0001, 0x03ff, 0x0400, 0x7c00, 0xfc00, 0x8000, 0x7bff, 0xc000, 0x8001};
  k3::write_safetensors(path, {{"bf", DType::BF16, {7}, bf16.data()}, {"h", DType::F16, {10}, f16.data()}});
  SafeTensors st = SafeTensors::open(path);

  std::vector<float> b = st.read_f32("bf", {7});
  ASSERT_EQ(b.size(), 7u);
  EXPECT_EQ(b[0], 1.0f);
  EXPECT_EQ(f32_bits(b[1]), 0x80000000u);  // -0.0 keeps its sign
  EXPECT_TRUE(std::isinf(b[2]) && b[2] > 0);
  EXPECT_TRUE(std::isinf(b[3]) && b[3] < 0);
  EXPECT_EQ(f32_bits(b[4]), 0x00010000u);  // bf16 subnormal widens bit-exactly
  EXPECT_EQ(b[5], 1.5f);
  for (size_t i = 0; i < bf16.size(); ++i) EXPECT_EQ(f32_bits(b[i]), uint32_t(bf16[i]) << 16) << i;

  std::vector<float> h = st.read_f32("h", {10});
  ASSERT_EQ(h.size(), 10u);
  EXPECT_EQ(h[0], 1.0f);
  EXPECT_EQ(h[1], std::ldexp(1.0f, -24));     // smallest subnormal
  EXPECT_EQ(h[2], std::ldexp(1023.0f, -24));  // largest subnormal
  EXPECT_EQ(h[3], std::ldexp(1.0f, -14));     // smallest normal
  EXPECT_TRUE(std::isinf(h[4]) && h[4] > 0);
  EXPECT_TRUE(std::isinf(h[5]) && h[5] < 0);
  EXPECT_EQ(f32_bits(h[6]), 0x80000000u);  // -0.0
  EXPECT_EQ(h[7], 65504.0f);               // largest finite f16
  EXPECT_EQ(h[8], -2.0f);
  EXPECT_EQ(h[9], -std::ldexp(1.0f, -24));
}

TEST(SafeTensorsRoundTrip, ReadF32WidensF16NaN) {
  TempDir dir;
  const std::string path = dir.file("nan.safetensors");
  std::vector<uint16_t> f16 = {0x7e00, 0xfc01};
  std::vector<uint16_t> bf16 = {0x7fc0};
  k3::write_safetensors(path, {{"h", DType::F16, {2}, f16.data()}, {"b", DType::BF16, {1}, bf16.data()}});
  SafeTensors st = SafeTensors::open(path);
  for (float x : st.read_f32("h")) EXPECT_TRUE(std::isnan(x));
  EXPECT_TRUE(std::isnan(st.read_f32("b")[0]));
}

TEST(SafeTensorsRoundTrip, ReadF32ShapeMismatchNamesTensorAndBothShapes) {
  TempDir dir;
  const std::string path = dir.file("s.safetensors");
  std::vector<float> v(6, 1.0f);
  k3::write_safetensors(path, {{"blk.w", DType::F32, {2, 3}, v.data()}});
  SafeTensors st = SafeTensors::open(path);
  EXPECT_THAT(error_of([&] {
                st.read_f32("blk.w", {3, 2});
              }),
              AllOf(HasSubstr(path), HasSubstr("blk.w"), HasSubstr("[2, 3]"), HasSubstr("[3, 2]")));
  EXPECT_THAT(error_of([&] { st.read_f32("blk.w", {6}); }),
              AllOf(HasSubstr("blk.w"), HasSubstr("[2, 3]"), HasSubstr("[6]")));
  EXPECT_EQ(st.read_f32("blk.w", {2, 3}).size(), 6u);
}

TEST(SafeTensorsRoundTrip, GetMissingTensorNamesTensorAndFile) {
  TempDir dir;
  const std::string path = dir.file("g.safetensors");
  std::vector<float> v = {1.0f};
  k3::write_safetensors(path, {{"present", DType::F32, {1}, v.data()}});
  SafeTensors st = SafeTensors::open(path);
  EXPECT_THAT(error_of([&] { st.get("model.absent.weight"); }),
              AllOf(HasSubstr(path), HasSubstr("model.absent.weight")));
  EXPECT_THAT(error_of([&] { st.read_f32("model.absent.weight"); }), HasSubstr("model.absent.weight"));
  EXPECT_THAT(error_of([&] { st.read_i64("model.absent.weight"); }), HasSubstr("model.absent.weight"));
}

TEST(SafeTensorsRoundTrip, WrongDtypeForReaderNamesTensorAndDtype) {
  TempDir dir;
  const std::string path = dir.file("d.safetensors");
  std::vector<uint8_t> u8 = {1, 2};
  std::vector<float> f = {1.0f};
  std::vector<int64_t> i = {5};
  k3::write_safetensors(path, {{"bytes", DType::U8, {2}, u8.data()},
                               {"flt", DType::F32, {1}, f.data()},
                               {"ints", DType::I64, {1}, i.data()}});
  SafeTensors st = SafeTensors::open(path);
  EXPECT_THAT(error_of([&] { st.read_f32("bytes"); }), AllOf(HasSubstr(path), HasSubstr("bytes"), HasSubstr("U8")));
  EXPECT_THAT(error_of([&] { st.read_f32("ints"); }), AllOf(HasSubstr("ints"), HasSubstr("I64")));
  EXPECT_THAT(error_of([&] { st.read_i64("flt"); }), AllOf(HasSubstr(path), HasSubstr("flt"), HasSubstr("F32")));
}

TEST(SafeTensorsRoundTrip, EmptyTensorsAreFine) {
  TempDir dir;
  const std::string path = dir.file("e.safetensors");
  std::vector<float> one = {4.0f};
  k3::write_safetensors(path, {{"empty.f32", DType::F32, {0, 5}, nullptr},
                               {"empty.i64", DType::I64, {0}, nullptr},
                               {"empty.bf16", DType::BF16, {3, 0}, nullptr},
                               {"one", DType::F32, {1}, one.data()}});
  SafeTensors st = SafeTensors::open(path);
  EXPECT_EQ(st.get("empty.f32").numel(), 0);
  EXPECT_EQ(st.get("empty.f32").nbytes, 0u);
  EXPECT_TRUE(st.read_f32("empty.f32", {0, 5}).empty());
  EXPECT_TRUE(st.read_f32("empty.bf16").empty());
  EXPECT_TRUE(st.read_i64("empty.i64").empty());
  EXPECT_EQ(st.read_f32("one"), one);
}

TEST(SafeTensorsRoundTrip, ScalarTensorHasOneElement) {
  TempDir dir;
  const std::string path = dir.file("scalar.safetensors");
  std::vector<float> v = {2.5f};
  k3::write_safetensors(path, {{"s", DType::F32, {}, v.data()}});
  SafeTensors st = SafeTensors::open(path);
  EXPECT_EQ(st.get("s").shape_str(), "[]");
  EXPECT_EQ(st.get("s").numel(), 1);
  EXPECT_EQ(st.read_f32("s"), v);
}

TEST(SafeTensorsWrite, RejectsBadTensorLists) {
  TempDir dir;
  const std::string path = dir.file("w.safetensors");
  std::vector<float> v(4, 0.0f);
  EXPECT_THAT(error_of([&] {
                k3::write_safetensors(path, {{"neg", DType::F32, {-1, 2}, v.data()}});
              }),
              AllOf(HasSubstr(path), HasSubstr("neg")));
  EXPECT_THAT(error_of([&] {
                k3::write_safetensors(path, {{"dup", DType::F32, {1}, v.data()}, {"dup", DType::F32, {1}, v.data()}});
              }),
              AllOf(HasSubstr(path), HasSubstr("dup")));
  EXPECT_THAT(error_of([&] {
                k3::write_safetensors(path, {{"__metadata__", DType::F32, {1}, v.data()}});
              }),
              AllOf(HasSubstr(path), HasSubstr("__metadata__")));
  EXPECT_TRUE(dir_entries(dir.path()).empty());
}

// ---------------------------------------------------------------------------------------------
// Sharded directories

struct ShardedFixture {
  std::vector<float> a = {1, 2, 3, 4};
  std::vector<uint16_t> b = {0x3f80, 0x4000};
  std::vector<int64_t> c = {10, 20, 30};
  std::vector<float> d = {-1.0f};

  void write(const TempDir& dir) {
    k3::write_safetensors(dir.file("model-00001-of-00002.safetensors"),
                          {{"layer.0.a", DType::F32, {2, 2}, a.data()}, {"layer.0.b", DType::BF16, {2}, b.data()}},
                          {{"shard", "1"}});
    k3::write_safetensors(dir.file("model-00002-of-00002.safetensors"),
                          {{"layer.1.c", DType::I64, {3}, c.data()}, {"layer.1.d", DType::F32, {1}, d.data()}});
  }
  static json index() {
    return {{"metadata", {{"total_size", 36}}},
            {"weight_map",
             {{"layer.0.a", "model-00001-of-00002.safetensors"},
              {"layer.0.b", "model-00001-of-00002.safetensors"},
              {"layer.1.c", "model-00002-of-00002.safetensors"},
              {"layer.1.d", "model-00002-of-00002.safetensors"}}}};
  }
};

void write_index(const TempDir& dir, const json& j) {
  write_bytes(dir.file("model.safetensors.index.json"), j.dump(2));  // as another program writes it
}

TEST(SafeTensorsSharded, OpenFindsAllTensorsInAllShards) {
  TempDir dir;
  ShardedFixture f;
  f.write(dir);
  write_index(dir, ShardedFixture::index());
  SafeTensors st = SafeTensors::open(dir.path().string());
  EXPECT_EQ(st.names(), (std::vector<std::string>{"layer.0.a", "layer.0.b", "layer.1.c", "layer.1.d"}));
  EXPECT_EQ(st.read_f32("layer.0.a", {2, 2}), f.a);
  EXPECT_EQ(st.read_f32("layer.0.b"), (std::vector<float>{1.0f, 2.0f}));
  EXPECT_EQ(st.read_i64("layer.1.c"), f.c);
  EXPECT_EQ(st.read_f32("layer.1.d"), f.d);
  EXPECT_EQ(*st.get("layer.0.a").file, dir.file("model-00001-of-00002.safetensors"));
  EXPECT_EQ(*st.get("layer.1.c").file, dir.file("model-00002-of-00002.safetensors"));
  EXPECT_EQ(st.metadata().at("shard"), "1");  // shard __metadata__ is merged
  EXPECT_THAT(error_of([&] { st.get("layer.2.a"); }), HasSubstr("layer.2.a"));
}

TEST(SafeTensorsSharded, IndexWinsOverTensorsItDoesNotPlaceInAShard) {
  TempDir dir;
  ShardedFixture f;
  f.write(dir);
  json j = ShardedFixture::index();
  j["weight_map"].erase("layer.0.b");  // present in shard 1, but the index does not list it
  write_index(dir, j);
  SafeTensors st = SafeTensors::open(dir.path().string());
  EXPECT_FALSE(st.has("layer.0.b"));
  EXPECT_TRUE(st.has("layer.0.a"));
}

TEST(SafeTensorsSharded, IndexNamingTensorAbsentFromItsShardThrows) {
  TempDir dir;
  ShardedFixture f;
  f.write(dir);
  json j = ShardedFixture::index();
  j["weight_map"]["layer.9.ghost"] = "model-00002-of-00002.safetensors";
  write_index(dir, j);
  EXPECT_THAT(open_error(dir.path().string()),
              AllOf(HasSubstr("model-00002-of-00002.safetensors"), HasSubstr("layer.9.ghost")));
}

TEST(SafeTensorsSharded, IndexPlacingTensorInTheWrongShardThrows) {
  TempDir dir;
  ShardedFixture f;
  f.write(dir);
  json j = ShardedFixture::index();
  j["weight_map"]["layer.1.c"] = "model-00001-of-00002.safetensors";
  write_index(dir, j);
  EXPECT_THAT(open_error(dir.path().string()),
              AllOf(HasSubstr("model-00001-of-00002.safetensors"), HasSubstr("layer.1.c")));
}

TEST(SafeTensorsSharded, IndexNamingMissingShardFileThrows) {
  TempDir dir;
  ShardedFixture f;
  f.write(dir);
  json j = ShardedFixture::index();
  j["weight_map"]["layer.1.d"] = "model-00003-of-00002.safetensors";
  write_index(dir, j);
  EXPECT_THAT(open_error(dir.path().string()), HasSubstr(dir.file("model-00003-of-00002.safetensors")));
}

TEST(SafeTensorsSharded, ShardNameThatIsNotAPlainFileNameIsRefused) {
  TempDir dir;
  ShardedFixture f;
  f.write(dir);
  fs::create_directories(dir.path() / "sub");
  k3::write_safetensors(dir.file("sub/x.safetensors"), {{"layer.1.d", DType::F32, {1}, f.d.data()}});
  for (std::string bad : {"sub/x.safetensors", "../x.safetensors", "/etc/passwd", "..", ".", ""}) {
    SCOPED_TRACE(bad);
    json j = ShardedFixture::index();
    j["weight_map"]["layer.1.d"] = bad;
    write_index(dir, j);
    std::string msg = open_error(dir.path().string());
    EXPECT_THAT(msg, HasSubstr("model.safetensors.index.json"));
    EXPECT_THAT(msg, HasSubstr("'" + bad + "'"));
  }
}

TEST(SafeTensorsSharded, BadIndexJsonThrowsNamingTheIndex) {
  TempDir dir;
  ShardedFixture f;
  f.write(dir);
  const std::string index = dir.file("model.safetensors.index.json");
  write_bytes(index, "{\"weight_map\": {");
  EXPECT_THAT(open_error(dir.path().string()), AllOf(HasSubstr(index), HasSubstr("JSON")));
  write_bytes(index, "{\"metadata\": {}}");
  EXPECT_THAT(open_error(dir.path().string()), AllOf(HasSubstr(index), HasSubstr("weight_map")));
  write_bytes(index, "{\"weight_map\": {}}");
  EXPECT_THAT(open_error(dir.path().string()), AllOf(HasSubstr(index), HasSubstr("weight_map")));
  write_bytes(index, "{\"weight_map\": {\"layer.0.a\": 3}}");
  EXPECT_THAT(open_error(dir.path().string()), AllOf(HasSubstr(index), HasSubstr("layer.0.a")));
}

TEST(SafeTensorsSharded, DirectoryWithOnePlainFileOpens) {
  TempDir dir;
  std::vector<float> v = {1.0f, 2.0f};
  k3::write_safetensors(dir.file("only.safetensors"), {{"w", DType::F32, {2}, v.data()}});
  k3::write_file_atomic(dir.file("config.json"), "{}");  // other files are ignored
  SafeTensors st = SafeTensors::open(dir.path().string());
  EXPECT_EQ(st.read_f32("w"), v);
}

TEST(SafeTensorsSharded, DirectoryWithTwoFilesAndNoIndexThrows) {
  TempDir dir;
  std::vector<float> v = {1.0f};
  k3::write_safetensors(dir.file("a.safetensors"), {{"w", DType::F32, {1}, v.data()}});
  k3::write_safetensors(dir.file("b.safetensors"), {{"u", DType::F32, {1}, v.data()}});
  EXPECT_THAT(open_error(dir.path().string()),
              AllOf(HasSubstr(dir.path().string()), HasSubstr("model.safetensors.index.json")));
}

TEST(SafeTensorsSharded, DirectoryWithNoCheckpointThrows) {
  TempDir dir;
  k3::write_file_atomic(dir.file("config.json"), "{}");
  EXPECT_THAT(open_error(dir.path().string()), HasSubstr(dir.path().string()));
}

size_t open_fd_count() {
  size_t n = 0;
  for (auto it = fs::directory_iterator("/proc/self/fd"); it != fs::directory_iterator(); ++it) ++n;
  return n;
}

TEST(SafeTensorsSharded, ShardThatIsADirectoryThrowsWithoutLeakingTheDescriptor) {
  TempDir dir;
  ShardedFixture f;
  f.write(dir);
  fs::create_directories(dir.path() / "model-00003-of-00003.safetensors");
  json j = ShardedFixture::index();
  j["weight_map"]["layer.1.d"] = "model-00003-of-00003.safetensors";
  write_index(dir, j);
  const size_t fds = open_fd_count();
  EXPECT_THAT(open_error(dir.path().string()),
              AllOf(HasSubstr(dir.file("model-00003-of-00003.safetensors")), HasSubstr("not a regular file")));
  EXPECT_EQ(open_fd_count(), fds);

  // Without an index, a lone "*.safetensors" directory is picked and refused the same way.
  TempDir dir2;
  fs::create_directories(dir2.path() / "only.safetensors");
  EXPECT_THAT(open_error(dir2.path().string()),
              AllOf(HasSubstr(dir2.file("only.safetensors")), HasSubstr("not a regular file")));
  EXPECT_EQ(open_fd_count(), fds);
}

TEST(SafeTensorsOpen, NonExistentPathThrows) {
  TempDir dir;
  const std::string p = dir.file("nope.safetensors");
  EXPECT_THAT(open_error(p), HasSubstr(p));
  const std::string q = dir.file("no/such/dir");
  EXPECT_THAT(open_error(q), HasSubstr(q));
}

// ---------------------------------------------------------------------------------------------
// Hand-made bad files

class SafeTensorsBadFile : public ::testing::Test {
 protected:
  // Writes header + data to a file and returns the k3::Error message from opening it.
  std::string open_raw(const std::string& header, const std::string& data) {
    write_raw(path_, header, data);
    return open_error(path_);
  }
  TempDir dir_;
  std::string path_ = dir_.file("bad.safetensors");
};

TEST_F(SafeTensorsBadFile, ShorterThanEightBytes) {
  for (size_t n : {0, 1, 7}) {
    SCOPED_TRACE(n);
    write_bytes(path_, std::string(n, '\x01'));
    EXPECT_THAT(open_error(path_), AllOf(HasSubstr(path_), HasSubstr("truncated")));
  }
}

TEST_F(SafeTensorsBadFile, HeaderLengthLargerThanFile) {
  std::string hdr = R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})";
  write_bytes(path_, le64(hdr.size() + 100) + hdr + std::string(4, '\0'));
  EXPECT_THAT(open_error(path_), AllOf(HasSubstr(path_), HasSubstr("truncated"), HasSubstr("header")));
}

TEST_F(SafeTensorsBadFile, HeaderLengthAboveBound) {
  write_bytes(path_, le64(200ull << 20) + "{}");
  EXPECT_THAT(open_error(path_), AllOf(HasSubstr(path_), HasSubstr("header length")));
  write_bytes(path_, le64(~0ull) + "{}");
  EXPECT_THAT(open_error(path_), AllOf(HasSubstr(path_), HasSubstr("header length")));
}

TEST_F(SafeTensorsBadFile, HeaderIsNotJson) {
  EXPECT_THAT(open_raw("{\"w\": {\"dtype\": ", ""), AllOf(HasSubstr(path_), HasSubstr("header"), HasSubstr("JSON")));
  EXPECT_THAT(open_raw(std::string(16, '\0'), ""), AllOf(HasSubstr(path_), HasSubstr("JSON")));
}

TEST_F(SafeTensorsBadFile, HeaderIsNotAnObject) {
  EXPECT_THAT(open_raw("[1, 2, 3]", ""), AllOf(HasSubstr(path_), HasSubstr("not a JSON object")));
  EXPECT_THAT(open_raw("\"text\"", ""), AllOf(HasSubstr(path_), HasSubstr("not a JSON object")));
}

TEST_F(SafeTensorsBadFile, EntryIsNotAnObject) {
  EXPECT_THAT(open_raw(R"({"w": 5})", ""), AllOf(HasSubstr(path_), HasSubstr("'w'")));
}

TEST_F(SafeTensorsBadFile, BadMetadata) {
  EXPECT_THAT(open_raw(R"({"__metadata__": [1]})", ""), AllOf(HasSubstr(path_), HasSubstr("__metadata__")));
  EXPECT_THAT(open_raw(R"({"__metadata__": {"k": 1}})", ""),
              AllOf(HasSubstr(path_), HasSubstr("__metadata__"), HasSubstr("\"k\"")));
}

TEST_F(SafeTensorsBadFile, UnknownDtype) {
  for (std::string dt : {"F64", "Q4", "I8", "f32", ""}) {
    SCOPED_TRACE(dt);
    std::string msg =
        open_raw(R"({"w.q":{"dtype":")" + dt + R"(","shape":[1],"data_offsets":[0,8]}})", std::string(8, '\0'));
    EXPECT_THAT(msg, AllOf(HasSubstr(path_), HasSubstr("'w.q'"), HasSubstr("dtype")));
  }
}

TEST_F(SafeTensorsBadFile, MissingOrMistypedFields) {
  const std::string data(4, '\0');
  EXPECT_THAT(open_raw(R"({"w":{"shape":[1],"data_offsets":[0,4]}})", data),
              AllOf(HasSubstr(path_), HasSubstr("'w'"), HasSubstr("dtype")));
  EXPECT_THAT(open_raw(R"({"w":{"dtype":7,"shape":[1],"data_offsets":[0,4]}})", data),
              AllOf(HasSubstr("'w'"), HasSubstr("dtype")));
  EXPECT_THAT(open_raw(R"({"w":{"dtype":"F32","data_offsets":[0,4]}})", data),
              AllOf(HasSubstr(path_), HasSubstr("'w'"), HasSubstr("shape")));
  EXPECT_THAT(open_raw(R"({"w":{"dtype":"F32","shape":1,"data_offsets":[0,4]}})", data),
              AllOf(HasSubstr("'w'"), HasSubstr("shape")));
  EXPECT_THAT(open_raw(R"({"w":{"dtype":"F32","shape":[1]}})", data),
              AllOf(HasSubstr(path_), HasSubstr("'w'"), HasSubstr("data_offsets")));
  EXPECT_THAT(open_raw(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4,8]}})", data),
              AllOf(HasSubstr(path_), HasSubstr("'w'"), HasSubstr("data_offsets")));
  EXPECT_THAT(open_raw(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[4]}})", data),
              AllOf(HasSubstr("'w'"), HasSubstr("data_offsets")));
  EXPECT_THAT(open_raw(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":{"a":0,"b":4}}})", data),
              AllOf(HasSubstr("'w'"), HasSubstr("data_offsets")));
  EXPECT_THAT(open_raw(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0,"4"]}})", data),
              AllOf(HasSubstr("'w'"), HasSubstr("data_offsets")));
  EXPECT_THAT(open_raw(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4.0]}})", data),
              AllOf(HasSubstr("'w'"), HasSubstr("data_offsets")));
  EXPECT_THAT(open_raw(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[-4,0]}})", data),
              AllOf(HasSubstr("'w'"), HasSubstr("data_offsets")));
  EXPECT_THAT(open_raw(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0,1e30]}})", data),
              AllOf(HasSubstr("'w'"), HasSubstr("data_offsets")));
}

TEST_F(SafeTensorsBadFile, ShapeTimesDtypeSizeDisagreesWithSpan) {
  // F32 [2, 2] needs 16 bytes, the offsets give 8.
  std::string msg =
      open_raw(R"({"lying.w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,8]}})", std::string(16, '\0'));
  EXPECT_THAT(msg,
              AllOf(HasSubstr(path_), HasSubstr("'lying.w'"), HasSubstr("[2, 2]"), HasSubstr("16"), HasSubstr("8")));
  // BF16 [3] needs 6 bytes, the offsets give 8.
  msg = open_raw(R"({"b":{"dtype":"BF16","shape":[3],"data_offsets":[0,8]}})", std::string(8, '\0'));
  EXPECT_THAT(msg, AllOf(HasSubstr(path_), HasSubstr("'b'"), HasSubstr("[3]")));
}

TEST_F(SafeTensorsBadFile, ShapeWhoseByteSizeOverflowsIsRefused) {
  // numel = 2^61 I64 elements = 2^64 bytes: wraps to 0 in 64-bit arithmetic and must not pass as an
  // empty span.
  std::string msg = open_raw(R"({"huge":{"dtype":"I64","shape":[2305843009213693952],"data_offsets":[0,0]}})", "");
  EXPECT_THAT(msg, AllOf(HasSubstr(path_), HasSubstr("'huge'")));
  msg = open_raw(R"({"huge":{"dtype":"F32","shape":[4611686018427387904],"data_offsets":[0,0]}})", "");
  EXPECT_THAT(msg, AllOf(HasSubstr(path_), HasSubstr("'huge'")));
  msg = open_raw(R"({"huge":{"dtype":"F32","shape":[65536,65536,65536,65536],"data_offsets":[0,0]}})", "");
  EXPECT_THAT(msg, AllOf(HasSubstr(path_), HasSubstr("'huge'")));
  msg = open_raw(R"({"huge":{"dtype":"U8","shape":[18446744073709551615],"data_offsets":[0,0]}})", "");
  EXPECT_THAT(msg, AllOf(HasSubstr(path_), HasSubstr("'huge'")));
}

TEST_F(SafeTensorsBadFile, DataOffsetsPastEndOfFile) {
  // Truncated data: the header promises 16 bytes, the file holds 8.
  std::string msg = open_raw(R"({"t.w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", std::string(8, '\0'));
  EXPECT_THAT(msg, AllOf(HasSubstr(path_), HasSubstr("'t.w'"), HasSubstr("data_offsets"), HasSubstr("16")));
  // Header lying about offsets: consistent size, but placed beyond the data.
  msg = open_raw(R"({"t.w":{"dtype":"F32","shape":[1],"data_offsets":[1000,1004]}})", std::string(8, '\0'));
  EXPECT_THAT(msg, AllOf(HasSubstr(path_), HasSubstr("'t.w'"), HasSubstr("1004")));
  // Huge offsets must not wrap around.
  msg = open_raw(R"({"t.w":{"dtype":"U8","shape":[1],"data_offsets":[18446744073709551615,18446744073709551615]}})",
                 std::string(8, '\0'));
  EXPECT_THAT(msg, AllOf(HasSubstr(path_), HasSubstr("'t.w'")));
}

TEST_F(SafeTensorsBadFile, BeginAfterEnd) {
  std::string msg = open_raw(R"({"r":{"dtype":"U8","shape":[4],"data_offsets":[8,4]}})", std::string(8, '\0'));
  EXPECT_THAT(msg, AllOf(HasSubstr(path_), HasSubstr("'r'"), HasSubstr("begin")));
}

TEST_F(SafeTensorsBadFile, NegativeOrNonIntegerShapeEntry) {
  for (std::string shape : {"[-1]", "[2,-2]", "[1.5]", "[\"2\"]", "[[2]]", "[true]"}) {
    SCOPED_TRACE(shape);
    std::string msg = open_raw(R"({"neg":{"dtype":"U8","shape":)" + shape + R"(,"data_offsets":[0,0]}})", "");
    EXPECT_THAT(msg, AllOf(HasSubstr(path_), HasSubstr("'neg'"), HasSubstr("shape")));
  }
}

TEST_F(SafeTensorsBadFile, OverlappingTensors) {
  std::string msg = open_raw(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},
                                  "b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                             std::string(12, '\0'));
  EXPECT_THAT(msg, AllOf(HasSubstr(path_), HasSubstr("'a'"), HasSubstr("'b'"), HasSubstr("overlap")));
  // Identical spans.
  msg = open_raw(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},
                     "b":{"dtype":"U8","shape":[8],"data_offsets":[0,8]}})",
                 std::string(8, '\0'));
  EXPECT_THAT(msg, AllOf(HasSubstr(path_), HasSubstr("'a'"), HasSubstr("'b'"), HasSubstr("overlap")));
  // One span nested inside another, not adjacent in offset order to its container.
  msg = open_raw(R"({"big":{"dtype":"U8","shape":[64],"data_offsets":[0,64]},
                     "mid":{"dtype":"U8","shape":[8],"data_offsets":[8,16]},
                     "late":{"dtype":"U8","shape":[8],"data_offsets":[40,48]}})",
                 std::string(64, '\0'));
  EXPECT_THAT(msg, AllOf(HasSubstr(path_), HasSubstr("'big'"), HasSubstr("overlap")));
}

TEST_F(SafeTensorsBadFile, OverlapIsNotHiddenByAnEmptyTensorBetween) {
  // Sorted by begin: big [0,64), empty [8,8), late [40,48). late overlaps big; the empty tensor
  // sitting between them in offset order must not mask that.
  std::string msg = open_raw(R"({"big":{"dtype":"U8","shape":[64],"data_offsets":[0,64]},
                                  "empty":{"dtype":"F32","shape":[0],"data_offsets":[8,8]},
                                  "late":{"dtype":"U8","shape":[8],"data_offsets":[40,48]}})",
                             std::string(64, '\0'));
  EXPECT_THAT(msg, AllOf(HasSubstr(path_), HasSubstr("'big'"), HasSubstr("'late'"), HasSubstr("overlap")));
}

TEST_F(SafeTensorsBadFile, AdjacentAndEmptyTensorsDoNotOverlap) {
  std::vector<float> v = {1.0f, 2.0f, 3.0f};
  write_raw(path_, R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},
                      "z":{"dtype":"F32","shape":[0],"data_offsets":[4,4]},
                      "z2":{"dtype":"F32","shape":[0],"data_offsets":[8,8]},
                      "b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})",
            bytes_of(v));
  SafeTensors st = SafeTensors::open(path_);
  EXPECT_EQ(st.read_f32("a"), (std::vector<float>{1.0f, 2.0f}));
  EXPECT_EQ(st.read_f32("b"), (std::vector<float>{3.0f}));
  EXPECT_TRUE(st.read_f32("z").empty());
  EXPECT_TRUE(st.read_f32("z2").empty());
}

TEST_F(SafeTensorsBadFile, MisalignedTensorReadsCorrectlyFromAnAlignedCopy) {
  // Header padded so the data section starts 8-aligned in the file; then a 1-byte U8 tensor puts
  // the F32 at data offset 1 and the I64 at data offset 5: both misaligned.
  std::string hdr = R"({"pad":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},)"
                    R"("val":{"dtype":"F32","shape":[1],"data_offsets":[1,5]},)"
                    R"("idx":{"dtype":"I64","shape":[2],"data_offsets":[5,21]},)"
                    R"("h":{"dtype":"BF16","shape":[1],"data_offsets":[21,23]}})";
  while ((8 + hdr.size()) % 8 != 0) hdr.push_back(' ');
  const float val = 3.14159f;
  const int64_t idx[2] = {-7, int64_t(1) << 40};
  const uint16_t h = 0xc040;  // bf16 -3.0
  std::string data(23, '\0');
  data[0] = '\x2a';
  std::memcpy(&data[1], &val, 4);
  std::memcpy(&data[5], idx, 16);
  std::memcpy(&data[21], &h, 2);
  write_raw(path_, hdr, data);

  SafeTensors st = SafeTensors::open(path_);
  EXPECT_EQ(st.get("pad").data[0], 0x2a);
  const auto& v = st.get("val");
  EXPECT_EQ(reinterpret_cast<uintptr_t>(v.data) % 4, 0u);
  EXPECT_EQ(v.file_offset, 8 + hdr.size() + 1);
  EXPECT_EQ(st.read_f32("val", {1}), (std::vector<float>{val}));
  EXPECT_EQ(reinterpret_cast<uintptr_t>(st.get("idx").data) % 8, 0u);
  EXPECT_EQ(st.read_i64("idx"), (std::vector<int64_t>{idx[0], idx[1]}));
  EXPECT_EQ(reinterpret_cast<uintptr_t>(st.get("h").data) % 2, 0u);
  EXPECT_EQ(st.read_f32("h"), (std::vector<float>{-3.0f}));
}

TEST_F(SafeTensorsBadFile, EmptyHeaderObjectIsAnEmptyCheckpoint) {
  write_raw(path_, "{}", "");
  SafeTensors st = SafeTensors::open(path_);
  EXPECT_TRUE(st.names().empty());
}

TEST_F(SafeTensorsBadFile, ZeroElementTensorAtEndOfFileIsFine) {
  write_raw(path_, R"({"e":{"dtype":"I64","shape":[0,3],"data_offsets":[0,0]}})", "");
  SafeTensors st = SafeTensors::open(path_);
  EXPECT_EQ(st.get("e").numel(), 0);
  EXPECT_TRUE(st.read_i64("e").empty());
}

TEST(SafeTensorsTruncatedFixture, HalfOfRealCheckpointThrowsNamingFileAndTensor) {
  const fs::path fixture = std::string(K3_SOURCE_DIR) + "/tests/fixtures/k3-tiny-a/model.safetensors";
  if (!fs::exists(fixture)) GTEST_SKIP() << fixture << " not present";
  TempDir dir;
  const std::string path = dir.file("model.safetensors");
  std::string bytes;
  {
    std::ifstream in(fixture, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  ASSERT_GT(bytes.size(), 16u);
  // The intact fixture opens.
  SafeTensors full = SafeTensors::open(fixture.string());
  EXPECT_FALSE(full.names().empty());

  write_bytes(path, bytes.substr(0, bytes.size() / 2));
  std::string msg = open_error(path);
  EXPECT_THAT(msg, AllOf(HasSubstr(path), HasSubstr("tensor '")));
  bool names_a_real_tensor = false;
  for (const auto& n : full.names())
    if (msg.find("'" + n + "'") != std::string::npos) names_a_real_tensor = true;
  EXPECT_TRUE(names_a_real_tensor) << msg;

  // Cut inside the header too.
  write_bytes(path, bytes.substr(0, 100));
  EXPECT_THAT(open_error(path), AllOf(HasSubstr(path), HasSubstr("truncated")));
}

// ---------------------------------------------------------------------------------------------
// Atomic writes

bool has_temp_file(const fs::path& dir) {
  for (const auto& n : dir_entries(dir))
    if (n.find(".tmp.") != std::string::npos) return true;
  return false;
}

TEST(SafeTensorsAtomicWrite, OverwritingReplacesTheFile) {
  TempDir dir;
  const std::string path = dir.file("m.safetensors");
  std::vector<float> big(1000, 9.0f);
  k3::write_safetensors(path, {{"old", DType::F32, {1000}, big.data()}}, {{"v", "1"}});
  const auto old_size = fs::file_size(path);
  std::vector<float> small = {1.0f, 2.0f};
  k3::write_safetensors(path, {{"new", DType::F32, {2}, small.data()}}, {{"v", "2"}});
  EXPECT_LT(fs::file_size(path), old_size);
  SafeTensors st = SafeTensors::open(path);
  EXPECT_EQ(st.names(), (std::vector<std::string>{"new"}));
  EXPECT_EQ(st.read_f32("new"), small);
  EXPECT_EQ(st.metadata().at("v"), "2");
  EXPECT_EQ(dir_entries(dir.path()), (std::vector<std::string>{"m.safetensors"}));
}

TEST(SafeTensorsAtomicWrite, AMappedInputIsNeverReplacedAndARenameKeepsItsViewIntact) {
  TempDir dir;
  const std::string path = dir.file("m.safetensors");
  std::vector<float> a = {1.0f, 2.0f};
  k3::write_safetensors(path, {{"w", DType::F32, {2}, a.data()}});
  SafeTensors old = SafeTensors::open(path);
  std::vector<float> b = {5.0f, 6.0f};
  // This process reads it: its own writer refuses to replace it (io/output_file.h).
  EXPECT_THAT(error_of([&] {
                k3::write_safetensors(path, {{"w", DType::F32, {2}, b.data()}});
              }),
              HasSubstr("is an input of this command"));
  // Another program replacing it the atomic way (a new file renamed over it) leaves the mapping intact.
  k3::write_safetensors(dir.file("new.safetensors"), {{"w", DType::F32, {2}, b.data()}});
  ASSERT_EQ(std::rename(dir.file("new.safetensors").c_str(), path.c_str()), 0);
  EXPECT_EQ(old.read_f32("w"), a);  // rename replaced the inode; the old mapping is untouched
  EXPECT_EQ(SafeTensors::open(path).read_f32("w"), b);
}

TEST(SafeTensorsAtomicWrite, NoTempFileRemainsAfterSuccess) {
  TempDir dir;
  std::vector<float> v = {1.0f};
  k3::write_safetensors(dir.file("a.safetensors"), {{"w", DType::F32, {1}, v.data()}});
  k3::write_file_atomic(dir.file("b.json"), "{\"x\": 1}\n");
  k3::write_file_atomic(dir.file("b.json"), "{\"x\": 2}\n");
  EXPECT_FALSE(has_temp_file(dir.path()));
  EXPECT_EQ(dir_entries(dir.path()), (std::vector<std::string>{"a.safetensors", "b.json"}));
  std::ifstream in(dir.file("b.json"));
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_EQ(text, "{\"x\": 2}\n");
}

TEST(SafeTensorsAtomicWrite, WritingIntoMissingDirectoryThrowsAndLeavesNothing) {
  TempDir dir;
  const std::string path = dir.file("missing/sub/m.safetensors");
  std::vector<float> v = {1.0f};
  EXPECT_THAT(error_of([&] { k3::write_safetensors(path, {{"w", DType::F32, {1}, v.data()}}); }), HasSubstr(path));
  EXPECT_THAT(error_of([&] { k3::write_file_atomic(path, "text"); }), HasSubstr(path));
  EXPECT_FALSE(fs::exists(dir.path() / "missing"));
  EXPECT_TRUE(dir_entries(dir.path()).empty());
}

TEST(SafeTensorsAtomicWrite, FailedRenameRemovesTheTempFile) {
  TempDir dir;
  // The destination is a non-empty directory, so rename() fails after the temp file is written.
  const std::string path = dir.file("target");
  fs::create_directories(fs::path(path) / "child");
  std::vector<float> v = {1.0f};
  EXPECT_THAT(error_of([&] { k3::write_safetensors(path, {{"w", DType::F32, {1}, v.data()}}); }), HasSubstr(path));
  EXPECT_FALSE(has_temp_file(dir.path()));
  EXPECT_TRUE(fs::is_directory(fs::path(path) / "child"));
}

}  // namespace
