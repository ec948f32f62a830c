// A stand-in for the NVIDIA driver's libcuda.so.1 (its soname), loaded only into a process
// that builds plans for a GPU it does not have (fastattn/target.py: `fastattn warm --for`).
// cuDNN's deviceless build needs no device, but it still loads each kernel it generates
// (cuLibraryLoadData, cuLibraryGetKernel) and asks how many devices there are: these answer
// with success and opaque handles, so that the build finishes and the plan serializes, with
// the kernel's cubin inside. It is not a driver: it loads and runs nothing, and every other
// entry point of cuda.h (setup.py adds one per function, from the headers the build uses)
// returns CUDA_ERROR_STUB_LIBRARY, as the CUDA toolkit's stub libcuda does. Plans built so
// load and run bitwise like plans built on the GPU (docs/DECISIONS.md, "Plans built without
// the GPU").
#include <stdint.h>

enum { kSuccess = 0, kStubLibrary = 34 };

int cuInit(unsigned flags) {
    (void)flags;
    return kSuccess;
}

int cuDeviceGetCount(int *count) {
    *count = 1;
    return kSuccess;
}

// CUDA 13.0: what the plans' kernels are built for is cuDNN's choice, from the device
// properties; the version only has to be one cuDNN accepts.
int cuDriverGetVersion(int *version) {
    *version = 13000;
    return kSuccess;
}

// Opaque, distinct, never dereferenced by cuDNN: a build only keeps them to unload.
int cuLibraryLoadData(void **library, const void *code, void *jit_options, void *jit_values, unsigned n_jit,
                      void *library_options, void *library_values, unsigned n_library) {
    static uintptr_t next = 0x1000;
    (void)code, (void)jit_options, (void)jit_values, (void)n_jit, (void)library_options, (void)library_values,
        (void)n_library;
    *library = (void *)(next += 0x10);
    return kSuccess;
}

int cuLibraryGetKernel(void **kernel, void *library, const char *name) {
    (void)name;
    *kernel = (char *)library + 1;
    return kSuccess;
}

int cuLibraryUnload(void *library) {
    (void)library;
    return kSuccess;
}

int cuGetErrorString(int error, const char **text) {
    *text = error == kStubLibrary ? "fastattn's stand-in libcuda: no driver in this process (a plan build for "
                                    "another GPU)"
                                  : "fastattn's stand-in libcuda: not a driver";
    return kSuccess;
}

int cuGetErrorName(int error, const char **name) {
    *name = error == kStubLibrary ? "CUDA_ERROR_STUB_LIBRARY" : "CUDA_ERROR_UNKNOWN";
    return kSuccess;
}
