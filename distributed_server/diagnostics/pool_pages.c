/* pool_pages: give the pages of the small-object allocator's empty pools back to the OS.
 *
 * CPython's small-object allocator (pymalloc) takes 1 MiB arenas from the OS, cut into
 * 16 KiB pools. It gives an arena back only when every pool in it is empty, so a few
 * objects that outlive a big release keep whole arenas mapped and resident: after a
 * million-task release the scheduler held 700-1,100 empty pools (11-18 MB of RSS) in
 * arenas that a handful of live blocks kept.
 *
 * `release()` returns the pages of those empty pools, all but each pool's first page,
 * with madvise(MADV_DONTNEED). The first page holds the pool header, and the header of
 * an empty pool is all that the allocator reads of it: the arena's list of empty pools
 * runs through the headers. The header's size class is set to the value the allocator
 * gives a pool it has never used, so a pool taken again is set up from its header alone
 * (its old free list, which ran through the dropped pages, is never followed: dropped
 * pages read back as zeros).
 *
 * Which memory is an arena is known exactly, not guessed: `install()` wraps the arena
 * allocator (PyObject_SetArenaAllocator, a public API) and records every arena-sized
 * block it hands out until it is freed. Arenas allocated before `install()` are not
 * touched. Everything here runs with the GIL held, as the allocator itself does (one
 * interpreter: subinterpreters with their own GIL would each call the arena allocator).
 *
 * The pool header's layout is the one of CPython 3.10 to 3.13 on 64-bit builds with
 * the radix tree (1 MiB arenas, 16 KiB pools, 16-byte alignment, 32 size classes).
 * Before it touches an arena, `release()` checks every pool header in it against that
 * layout and leaves the arena alone if one does not fit. With another layout, a
 * free-threaded build (no pymalloc), pages of 16 KiB or more, or on another OS than
 * Linux, `install()` refuses and nothing is released.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Linux only (mincore, and madvise that frees at once); elsewhere install() refuses. */
#if defined(__linux__) && !defined(Py_GIL_DISABLED) \
        && PY_VERSION_HEX >= 0x030A0000 && PY_VERSION_HEX < 0x030E0000
#define POOL_PAGES 1
#include <sys/mman.h>
#include <unistd.h>
#else
#define POOL_PAGES 0
#endif

#define ARENA_SIZE ((size_t)1 << 20)
#define POOL_SIZE ((uintptr_t)1 << 14)
#define POOL_OVERHEAD 48
#define ALIGNMENT 16
#define SIZE_CLASSES 32
#define DUMMY_SIZE_IDX 0xffff
#define MIN_PAGE 4096

struct pool_header {
    union {
        void *padding;
        unsigned int count;  /* blocks in use */
    } ref;
    void *freeblock;
    struct pool_header *nextpool;
    struct pool_header *prevpool;
    unsigned int arenaindex;
    unsigned int szidx;
    unsigned int nextoffset;
    unsigned int maxnextoffset;
};

static size_t n_arenas = 0;
static unsigned long long untracked = 0;  /* arenas that could not be recorded */

#if POOL_PAGES
static PyObjectArenaAllocator wrapped;
static int installed = 0;
static void **arenas = NULL;  /* the arenas handed out since install(), not yet freed */
static size_t cap_arenas = 0;

static void *
arena_alloc(void *ctx, size_t size)
{
    void *address = wrapped.alloc(wrapped.ctx, size);
    if (address == NULL || size != ARENA_SIZE) {
        return address;
    }
    if (n_arenas == cap_arenas) {
        size_t cap = cap_arenas ? 2 * cap_arenas : 256;
        void **grown = realloc(arenas, cap * sizeof(void *));
        if (grown == NULL) {
            untracked++;  /* left alone by release(): harmless, only not returned */
            return address;
        }
        arenas = grown;
        cap_arenas = cap;
    }
    arenas[n_arenas++] = address;
    return address;
}

static void
arena_free(void *ctx, void *address, size_t size)
{
    if (size == ARENA_SIZE) {
        for (size_t i = n_arenas; i-- > 0;) {
            if (arenas[i] == address) {
                arenas[i] = arenas[--n_arenas];
                break;
            }
        }
    }
    wrapped.free(wrapped.ctx, address, size);
}

static int
header_is_blank(const struct pool_header *pool)
{
    static const struct pool_header zero;
    return memcmp(pool, &zero, sizeof zero) == 0;
}

/* A header the allocator wrote: in use or empty, or one of ours (empty, dummy class). */
static int
header_fits(const struct pool_header *pool, unsigned int arenaindex)
{
    if (pool->arenaindex != arenaindex || pool->nextoffset > POOL_SIZE) {
        return 0;
    }
    if (pool->szidx == DUMMY_SIZE_IDX) {
        return pool->ref.count == 0;
    }
    if (pool->szidx >= SIZE_CLASSES) {
        return 0;
    }
    unsigned int size = (pool->szidx + 1) * ALIGNMENT;
    return pool->maxnextoffset == POOL_SIZE - size
        && pool->nextoffset >= POOL_OVERHEAD
        && pool->ref.count <= (POOL_SIZE - POOL_OVERHEAD) / size;
}

/* The pages of one arena's empty pools, after its headers are checked; -1 if one does
 * not fit (then nothing in the arena is touched). At most *budget pools are given back
 * (none left: it stops), each taken off *budget. */
static Py_ssize_t
release_arena(uintptr_t base, size_t page, unsigned char *resident, Py_ssize_t *budget)
{
    uintptr_t first = (base + POOL_SIZE - 1) & ~(POOL_SIZE - 1);
    uintptr_t end = base + ARENA_SIZE;
    if (mincore((void *)base, ARENA_SIZE, resident) != 0) {
        return -1;
    }
    if (!(resident[(first - base) / page] & 1)) {
        return -1;  /* the allocator carves the first pool when it makes the arena */
    }
    unsigned int arenaindex = ((struct pool_header *)first)->arenaindex;
    for (uintptr_t pool = first; pool + POOL_SIZE <= end; pool += POOL_SIZE) {
        const struct pool_header *header = (const struct pool_header *)pool;
        if ((resident[(pool - base) / page] & 1) && !header_is_blank(header)
                && !header_fits(header, arenaindex)) {
            return -1;
        }
    }
    Py_ssize_t released = 0;
    for (uintptr_t pool = first; pool + POOL_SIZE <= end; pool += POOL_SIZE) {
        struct pool_header *header = (struct pool_header *)pool;
        size_t index = (pool - base) / page;
        if (!(resident[index] & 1) || header_is_blank(header) || header->ref.count != 0) {
            continue;  /* never carved, or in use */
        }
        Py_ssize_t tail = 0;
        for (size_t i = index + 1; i < index + POOL_SIZE / page; i++) {
            tail += (resident[i] & 1) ? (Py_ssize_t)page : 0;
        }
        if (header->szidx == DUMMY_SIZE_IDX && tail == 0) {
            continue;  /* released before and not used since */
        }
        if (*budget == 0) {
            break;
        }
        (*budget)--;
        header->szidx = DUMMY_SIZE_IDX;
        if (madvise((void *)(pool + page), POOL_SIZE - page, MADV_DONTNEED) == 0) {
            released += tail;
        }
    }
    return released;
}
#endif

PyDoc_STRVAR(install_doc,
"install() -> bool\n\n"
"Wrap the arena allocator so that `release` knows every arena made from now on.\n"
"Idempotent; False where this allocator layout is not supported.");

static PyObject *
install(PyObject *module, PyObject *unused)
{
#if !POOL_PAGES
    Py_RETURN_FALSE;  /* not Linux, no pymalloc, or a pool layout not checked against */
#else
    long page = sysconf(_SC_PAGESIZE);
    if (sizeof(void *) != 8 || page < MIN_PAGE || (uintptr_t)page >= POOL_SIZE) {
        Py_RETURN_FALSE;
    }
    if (!installed) {
        PyObjectArenaAllocator ours;
        PyObject_GetArenaAllocator(&wrapped);
        ours.ctx = NULL;
        ours.alloc = arena_alloc;
        ours.free = arena_free;
        PyObject_SetArenaAllocator(&ours);
        installed = 1;
    }
    Py_RETURN_TRUE;
#endif
}

PyDoc_STRVAR(release_doc,
"release(max_pools=-1) -> (int, bool)\n\n"
"Give back the resident pages of the empty pools in the arenas known since `install`\n"
"(all but each pool's first page), at most max_pools of them (negative: no limit;\n"
"each costs a system call, about 2 us). (Bytes given back, whether every empty pool\n"
"is given back now.)");

static PyObject *
release(PyObject *module, PyObject *args)
{
    Py_ssize_t budget = -1;
    if (!PyArg_ParseTuple(args, "|n:release", &budget)) {
        return NULL;
    }
    Py_ssize_t released = 0;
#if POOL_PAGES
    long page = sysconf(_SC_PAGESIZE);
    unsigned char resident[ARENA_SIZE / MIN_PAGE];
    if (installed && page >= MIN_PAGE && (uintptr_t)page < POOL_SIZE) {
        for (size_t i = 0; i < n_arenas && budget != 0; i++) {
            Py_ssize_t got = release_arena((uintptr_t)arenas[i], (size_t)page, resident,
                                           &budget);
            if (got > 0) {
                released += got;
            }
        }
    }
    /* a spent budget may have met the last empty pool: the next call finds nothing */
    return Py_BuildValue("(nO)", released, budget == 0 ? Py_False : Py_True);
#else
    return Py_BuildValue("(nO)", released, Py_True);
#endif
}

PyDoc_STRVAR(arenas_doc,
"arenas() -> tuple\n\n"
"(arenas known now, arenas that could not be recorded) since `install`.");

static PyObject *
arenas_known(PyObject *module, PyObject *unused)
{
    return Py_BuildValue("(nK)", (Py_ssize_t)n_arenas, untracked);
}

static PyMethodDef methods[] = {
    {"install", install, METH_NOARGS, install_doc},
    {"release", release, METH_VARARGS, release_doc},
    {"arenas", arenas_known, METH_NOARGS, arenas_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    "pool_pages",
    "Give the pages of the small-object allocator's empty pools back to the OS.",
    -1,
    methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC
PyInit_pool_pages(void)
{
    return PyModule_Create(&module_def);
}
