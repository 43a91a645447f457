// Helpers of the `k3 serve` tests: a tokenizer for the k3-tiny fixture model, and a server listening on the
// loopback on its own thread.
#pragma once
#include <httplib.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <thread>

#include "compare.h"
#include "model/engine.h"
#include "serve/server.h"
#include "temp_dir.h"
#include "tiny_tokenizer.h"
#include "tokenizer/tokenizer.h"

namespace k3test {

// The tiny tokenizer (tiny_tokenizer.h) as DIR/tok.
inline std::string write_tiny_tokenizer(const TempDir& dir) { return write_tiny_tokenizer(dir.path() / "tok"); }

// A server on an ephemeral loopback port, listening on its own thread until destroyed (by default over the
// k3-tiny fixture model on the CPU).
struct ServeOnLoopback {
  std::unique_ptr<k3::serve::Server> server;
  std::thread thread;
  int port = 0;
  ServeOnLoopback(const std::string& tok_dir, k3::serve::ServeOptions o)
      : ServeOnLoopback(k3::Engine::load(fixture("k3-tiny-a"), k3::EngineOptions{}), tok_dir, std::move(o)) {}
  ServeOnLoopback(std::unique_ptr<k3::Engine> engine, const std::string& tok_dir, k3::serve::ServeOptions o,
                  std::unique_ptr<const k3::VisionModel> vision = nullptr) {
    o.host = "127.0.0.1";
    o.port = 0;
    server =
        std::make_unique<k3::serve::Server>(std::move(engine), k3::Tokenizer::load_dir(tok_dir), o, std::move(vision));
    port = server->bind();
    thread = std::thread([this] { server->listen(); });
    for (int i = 0; i < 200 && !client().Get("/health"); ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ~ServeOnLoopback() {
    server->stop();
    thread.join();
  }
  httplib::Client client() const {
    httplib::Client c("127.0.0.1", port);
    c.set_read_timeout(300, 0);
    return c;
  }
};

}  // namespace k3test
