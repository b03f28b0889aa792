/* Batch copies for the loopback driver: one call per batch, no Python per descriptor.
 *
 * copy(src, dst, nbytes)           memcpy within this process
 * writev(pid, src, dst, nbytes)    process_vm_writev into another process, IOV_MAX at a time
 *
 * Arguments are C-contiguous buffers of uint64 of one length. Both release the GIL.
 * writev returns (errno, index of the first descriptor not fully written); (0, n) on success.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <stdint.h>
#include <string.h>
#include <sys/uio.h>

#define CHUNK 1024

static int take(PyObject *obj, Py_buffer *view) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS) < 0) return -1;
    if (view->len % 8) {
        PyBuffer_Release(view);
        PyErr_SetString(PyExc_TypeError, "expected a uint64 buffer");
        return -1;
    }
    return 0;
}

static int take3(PyObject *const *args, Py_buffer *v) {
    for (int i = 0; i < 3; i++) {
        if (take(args[i], &v[i]) < 0) {
            while (i--) PyBuffer_Release(&v[i]);
            return -1;
        }
    }
    if (v[0].len != v[1].len || v[0].len != v[2].len) {
        for (int i = 0; i < 3; i++) PyBuffer_Release(&v[i]);
        PyErr_SetString(PyExc_ValueError, "src, dst and nbytes differ in length");
        return -1;
    }
    return 0;
}

static PyObject *batch_copy(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Py_buffer v[3];
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "copy(src, dst, nbytes)");
        return NULL;
    }
    if (take3(args, v) < 0) return NULL;
    const uint64_t *s = v[0].buf, *d = v[1].buf, *n = v[2].buf;
    Py_ssize_t count = v[0].len / 8;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < count; i++)
        memcpy((void *)(uintptr_t)d[i], (const void *)(uintptr_t)s[i], (size_t)n[i]);
    Py_END_ALLOW_THREADS
    for (int i = 0; i < 3; i++) PyBuffer_Release(&v[i]);
    Py_RETURN_NONE;
}

static PyObject *batch_writev(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Py_buffer v[3];
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "writev(pid, src, dst, nbytes)");
        return NULL;
    }
    long pid = PyLong_AsLong(args[0]);
    if (pid == -1 && PyErr_Occurred()) return NULL;
    if (take3(args + 1, v) < 0) return NULL;
    const uint64_t *s = v[0].buf, *d = v[1].buf, *n = v[2].buf;
    Py_ssize_t count = v[0].len / 8, done = 0;
    int err = 0;
    struct iovec local[CHUNK], remote[CHUNK];
    Py_BEGIN_ALLOW_THREADS
    while (done < count && !err) {
        Py_ssize_t k = count - done < CHUNK ? count - done : CHUNK;
        size_t want = 0;
        for (Py_ssize_t i = 0; i < k; i++) {
            local[i].iov_base = (void *)(uintptr_t)s[done + i];
            remote[i].iov_base = (void *)(uintptr_t)d[done + i];
            local[i].iov_len = remote[i].iov_len = (size_t)n[done + i];
            want += (size_t)n[done + i];
        }
        ssize_t got = process_vm_writev((pid_t)pid, local, (unsigned long)k, remote,
                                        (unsigned long)k, 0);
        if (got < 0) {
            err = errno;
        } else if ((size_t)got != want) {
            /* Partial: find the first descriptor not fully written. */
            size_t left = (size_t)got;
            Py_ssize_t i = 0;
            while (i < k && left >= (size_t)n[done + i]) left -= (size_t)n[done + i++];
            done += i;
            err = EFAULT;
        } else {
            done += k;
        }
    }
    Py_END_ALLOW_THREADS
    for (int i = 0; i < 3; i++) PyBuffer_Release(&v[i]);
    return Py_BuildValue("(in)", err, done);
}

static PyMethodDef methods[] = {
    {"copy", (PyCFunction)(void (*)(void))batch_copy, METH_FASTCALL, "memcpy a batch"},
    {"writev", (PyCFunction)(void (*)(void))batch_writev, METH_FASTCALL,
     "process_vm_writev a batch"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_batchcopy", NULL, -1, methods};

PyMODINIT_FUNC PyInit__batchcopy(void) { return PyModule_Create(&module); }
