// Argument helpers shared by the k3 subcommands.
#pragma once
#include <CLI/CLI.hpp>
#include <cstdint>
#include <string>
#include <vector>

#include "kernels/gemm/linear.h"

namespace k3::cli {

// "1,2,3" -> {1,2,3}. Throws k3::Error naming the flag and the bad item.
std::vector<int32_t> parse_ids(const std::string& text, const std::string& flag);

// Throws k3::Error naming the flag, the bad id and the vocabulary of `source` (the config) when an id
// of rows is >= vocab_size, so the message points at the flag rather than at the model's own check.
void check_ids_in_vocab(const std::vector<std::vector<int32_t>>& rows, int64_t vocab_size, const std::string& flag,
                        const std::string& source);

// {1, 2, 3} -> "1 2 3" (the last line of stdout under --print-ids).
std::string join_ids(const std::vector<int32_t>& ids);

// "f32" -> GemmPrecision::F32, "f64" -> F64Accumulate; anything else throws k3::Error
// "<what> must be f32 or f64, got '<text>'" (what: the flag or variable that gave the text).
GemmPrecision parse_gemm_precision(const std::string& text, const std::string& what);

// The environment variable K3_GEMM (f32 or f64) into set_gemm_precision; unset or empty leaves the
// library default (F64Accumulate). Throws k3::Error "K3_GEMM must be f32 or f64, got 'x'". Called at the
// start of main() by k3 and by the benchmarks that run CPU linears, since the library reads no
// environment.
void apply_gemm_env();

// Seconds since the first call (for progress lines).
double elapsed_seconds();

// Makes every numeric option of app and its subcommands (CLI11 type FLOAT, INT or UINT) parse
// strictly: a float must be finite and within double's range ("nan", "inf", "1e400" are refused), an
// integer must be decimal and fit in 64 bits (CLI11 alone saturates "99999999999999999999" to
// INT64_MAX, wraps "-1" into an unsigned option and reads "010" as octal). Ranges are the library's
// business (core/validate.h); this only guarantees that the number is the one the user typed.
void add_strict_number_checks(CLI::App& app);

}  // namespace k3::cli
