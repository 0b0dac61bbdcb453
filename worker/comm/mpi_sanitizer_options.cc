// Sanitizer settings of the MPI programs (mlaserve-worker, mpi_model_check), compiled into them
// in the MLASERVE_SANITIZE build only (scripts/sanitize.sh).
//
// Open MPI 4.1 (Debian 12) leaves memory unreachable at MPI_Finalize and leaks some in MPI_Init
// (argv copies, PMIx values, hwloc bitmaps, ...: ~50 blocks, 120 KB per rank; seen with a bare
// MPI_Init / MPI_Allreduce / MPI_Finalize program). Those leaks are not ours and nothing can
// free them, so they are suppressed by the libraries they come from; leaks allocated in our own
// code are still reported. To name those libraries LeakSanitizer needs whole allocation stacks:
// its default frame-pointer unwinder stops at the first Open MPI frame (built without frame
// pointers), and many of the allocations are in MCA components that Open MPI has dlclose()d by
// the time of the check (frames of "<unknown module>"); DWARF unwinding at each malloc reaches
// the libmpi / libopen-pal / libpmix frames below them. That costs time per allocation, hence
// only in these programs (ASAN_OPTIONS given at run time still override it).
extern "C" const char* __asan_default_options() { return "fast_unwind_on_malloc=0"; }

// Matched suppressions are not listed at exit: a listing in sanitizer-reports/ would fail the
// stage (scripts/sanitize.sh) though nothing of ours leaked.
extern "C" const char* __lsan_default_options() { return "print_suppressions=0"; }

extern "C" const char* __lsan_default_suppressions() {
  return "leak:libmpi.so\n"
         "leak:libopen-pal.so\n"
         "leak:libopen-rte.so\n"
         "leak:libpmix.so\n"
         "leak:libhwloc.so\n"
         "leak:libevent_core\n"
         "leak:libevent_pthreads\n"
         "leak:/openmpi/\n";  // the MCA components, /usr/lib/x86_64-linux-gnu/openmpi/lib/openmpi3/
}
