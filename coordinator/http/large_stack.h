// Work that recurses with its input, run off civetweb's threads.
//
// Civetweb serves each connection on a thread with a 100 KiB stack (102,400 bytes in Debian's
// libcivetweb, by pthread_getattr_np). Rendering a chat template recurses once per nesting
// level: the DeepSeek-V3 template (the embedded tiny model's) takes ~30 KiB of stack in the -O2
// build and ~60 KiB under ASan, where it overflowed those 100 KiB in openai_server_test; a
// template of 62 nested macro calls through 45 ifs each takes ~470 KiB up to the renderer's
// depth bound (jinja::RenderLimits::max_depth), a SIGSEGV of mlaserve-openai in any build. So
// mlaserve-openai builds its chat prompts on a thread of their own, with a stack that holds the
// deepest rendering the limits allow (kChatPromptStackBytes).
#ifndef MLASERVE_COORDINATOR_HTTP_LARGE_STACK_H_
#define MLASERVE_COORDINATOR_HTTP_LARGE_STACK_H_

#include <cstddef>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"

namespace mlaserve::openai {

// A rendering max_depth (256) levels deep takes ~470 KiB in the -O2 build and ~660 KiB in the
// ASan build (measured; large_stack_test renders it on this stack); only the pages touched are
// ever backed by memory.
constexpr size_t kChatPromptStackBytes = size_t{4} << 20;

// Runs fn() to completion on a new thread with a stack of `stack_bytes` and rethrows here what it
// throws. An error (and fn not run) when the thread cannot be made.
absl::Status RunWithStack(size_t stack_bytes, absl::FunctionRef<void()> fn);

}  // namespace mlaserve::openai

#endif  // MLASERVE_COORDINATOR_HTTP_LARGE_STACK_H_
