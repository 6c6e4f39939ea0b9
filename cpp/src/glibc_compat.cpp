// Linked only into wheels (CMake: ALGENTA_GLIBC_STUBS), which must load on glibc 2.28.
//
// glibc 2.32 added the variable __libc_single_threaded; libstdc++'s inline code (shared_ptr and
// locale reference counts) reads it to skip atomic operations while a process has one thread,
// so objects compiled against newer glibc headers reference it, and glibc 2.28 would refuse to
// load the module. This module-local definition (hidden: it binds at link time and is never
// exported) says "not known to be single-threaded": reference counts are always atomic, which
// is what libstdc++ does on glibc older than 2.32. Correct in every process, at the cost of an
// atomic increment where a single-threaded one would do.
extern "C" {
__attribute__((visibility("hidden"))) char __libc_single_threaded = 0;
}
