"""Repository rule exposing the XLA FFI headers of the installed jaxlib as @<name>//:ffi_headers (untested)."""

def _jax_ffi_headers_impl(rctx):
    python = rctx.os.environ.get("DEEPINFER_PYTHON", "python3")
    result = rctx.execute([python, "-c", "import jax; print(jax.ffi.include_dir())"])
    if result.return_code != 0:
        fail("cannot locate the XLA FFI headers with %s: %s" % (python, result.stderr))
    rctx.symlink(result.stdout.strip(), "include")
    rctx.file("BUILD.bazel", """\
package(default_visibility = ["//visibility:public"])

cc_library(
    name = "ffi_headers",
    hdrs = glob(["include/xla/ffi/api/*.h"]),
    includes = ["include"],
)

filegroup(
    name = "ffi_header_files",
    srcs = glob(["include/xla/ffi/api/*.h"]),
)
""")

jax_ffi_headers = repository_rule(
    implementation = _jax_ffi_headers_impl,
    environ = ["DEEPINFER_PYTHON", "PATH"],
    local = True,
)
