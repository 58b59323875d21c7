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
 * `give_back_tails()` gives back whole, header page included, the empty pools above each
 * arena's last pool in use, by handing them back to the arena as pools it has never used
 * (see "arena tails" below). After a ten-million-task release that took the scheduler
 * from 54 to 51 MiB. `retire_pools()` takes the empty pools below an arena's last pool
 * in use out of the arena and gives them back whole too (see "retired pools"): what
 * remains of a kept arena is its pools in use and its first pool.
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
#define _GNU_SOURCE 1  /* process_vm_readv (the value Python.h gives it too) */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Linux only (mincore, and madvise that frees at once); elsewhere install() refuses. */
#if defined(__linux__) && !defined(Py_GIL_DISABLED) \
        && PY_VERSION_HEX >= 0x030A0000 && PY_VERSION_HEX < 0x030E0000
#define POOL_PAGES 1
#include <sys/mman.h>
#include <sys/uio.h>
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
/* An arena handed out since install(), not yet freed, and how many of its pools
 * `retire_pools` took out of it (its record's count of pools is that many less). */
struct tracked {
    void *address;
    unsigned int retired;
};
static struct tracked *arenas = NULL;
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
        struct tracked *grown = realloc(arenas, cap * sizeof(struct tracked));
        if (grown == NULL) {
            untracked++;  /* left alone by release(): harmless, only not returned */
            return address;
        }
        arenas = grown;
        cap_arenas = cap;
    }
    arenas[n_arenas].address = address;
    arenas[n_arenas].retired = 0;
    n_arenas++;
    return address;
}

static void
arena_free(void *ctx, void *address, size_t size)
{
    if (size == ARENA_SIZE) {
        for (size_t i = n_arenas; i-- > 0;) {
            if (arenas[i].address == address) {
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

/* ------------------------------------------------------------------ arena tails
 *
 * `release` keeps each empty pool's first page, because the arena's list of empty pools
 * runs through the headers. An arena also has pools it has never handed out: the ones at
 * or above its `pool_address`, which it carves (writes a fresh header) when it first needs
 * them, reading nothing of their old memory. `give_back_tails` turns the empty pools
 * above an arena's last pool in use into such pools: it takes them off the arena's list
 * of empty pools, lowers `pool_address` to the first of them and drops them whole. The
 * arena's count of free pools (which also orders the allocator's list of arenas) stays
 * the same, so nothing else of the allocator's bookkeeping changes. The arena's record
 * (`struct arena_object`, in the allocator's vector of them) is not exported: it is
 * found through the allocator's own pointer to that vector, a word of its static data
 * (`find_records`). Every known arena's record must read as expected, and an arena's list
 * of empty pools must agree with its record's counts, before a record is written; if
 * not, nothing is. A candidate vector is read with process_vm_readv, which fails instead
 * of faulting where memory is not mapped. The blocks of the arena allocator that are not
 * arenas (a deep frame's chunk of the interpreter's frame stack can be 1 MiB too) are
 * told apart by their first pool header and passed over.
 */
struct arena_record {  /* CPython 3.10-3.13: struct arena_object */
    uintptr_t address;
    char *pool_address;
    unsigned int nfreepools;
    unsigned int ntotalpools;
    struct pool_header *freepools;
    struct arena_record *nextarena;
    struct arena_record *prevarena;
};

#define MAX_POOLS ((unsigned int)(ARENA_SIZE / POOL_SIZE))

static unsigned int
first_pool_index(uintptr_t base)
{
    return ((const struct pool_header *)((base + POOL_SIZE - 1) & ~(POOL_SIZE - 1)))
        ->arenaindex;
}

/* Whether the tracked block at `base` is an arena of the allocator: its first pool's
 * header fits the layout. The arena allocator also hands out blocks that are not arenas
 * (the interpreter's frame stack takes chunks of it, of 1 MiB too for a deep frame). */
static int
is_arena(uintptr_t base)
{
    const struct pool_header *first =
        (const struct pool_header *)((base + POOL_SIZE - 1) & ~(POOL_SIZE - 1));
    return header_fits(first, first->arenaindex);
}

/* The pools the allocator cut the arena at `base` into (one less if it is not aligned
 * to a pool). */
static unsigned int
pools_in(uintptr_t base)
{
    return ((base & (POOL_SIZE - 1)) == 0) ? MAX_POOLS : MAX_POOLS - 1;
}

/* Whether `record` (read, not in place) is the record of the tracked arena. */
static int
record_reads_as(const struct arena_record *record, const struct tracked *arena)
{
    uintptr_t base = (uintptr_t)arena->address;
    uintptr_t first = (base + POOL_SIZE - 1) & ~(POOL_SIZE - 1);
    unsigned int total = pools_in(base);
    return record->address == base && record->ntotalpools + arena->retired == total
        && record->nfreepools <= record->ntotalpools
        && (uintptr_t)record->pool_address >= first
        && (uintptr_t)record->pool_address <= first + (uintptr_t)total * POOL_SIZE;
}

/* The record of the tracked arena in the vector that `vector_fits` accepted. */
static struct arena_record *
record_of(char *vector, const struct tracked *arena)
{
    struct arena_record *record =
        (struct arena_record *)(vector + (size_t)first_pool_index((uintptr_t)arena->address)
                                * sizeof(struct arena_record));
    return record_reads_as(record, arena) ? record : NULL;
}

/* Copies len bytes at `from` into `to`, or fails (0) where they are not mapped: a
 * candidate vector is read this way, since memory this thread does not own may be
 * unmapped by another thread at any moment. */
static int
read_safely(void *to, uintptr_t from, size_t len)
{
    struct iovec local = {to, len}, remote = {(void *)from, len};
    return process_vm_readv(getpid(), &local, 1, &remote, 1, 0) == (ssize_t)len;
}

/* Whether `vector` holds the record of every known arena (at least one), all within
 * [lo, hi). Tracked blocks that are not arenas are passed over. */
static int
vector_fits(char *vector, uintptr_t lo, uintptr_t hi)
{
    size_t matched = 0;
    for (size_t i = 0; i < n_arenas; i++) {
        uintptr_t base = (uintptr_t)arenas[i].address;
        if (!is_arena(base)) {
            continue;
        }
        uintptr_t at = (uintptr_t)vector
            + (uintptr_t)first_pool_index(base) * sizeof(struct arena_record);
        struct arena_record record;
        if (at < lo || at + sizeof record > hi || !read_safely(&record, at, sizeof record)
                || !record_reads_as(&record, &arenas[i])) {
            return 0;
        }
        matched++;
    }
    return matched > 0;
}

struct region {
    uintptr_t lo, hi;
    int allocator;  /* a mapping of the file that holds the allocator's code and data */
    int anonymous;  /* no file and no name (malloc's mmaps; not [heap], [stack]...) */
};

#define MAX_REGIONS 4096

/* The process's private writable mappings, in address order; how many (-1: error).
 * Those of the file that holds `PyObject_Malloc` (libpython, or the executable), and an
 * anonymous one right after the last of them (the rest of its bss), are marked. */
static int
load_regions(struct region *regions)
{
    FILE *maps = fopen("/proc/self/maps", "r");
    if (maps == NULL) {
        return -1;
    }
    uintptr_t code = (uintptr_t)&PyObject_Malloc;
    char line[512], owner[256] = "";
    unsigned long owner_inode = 0, owner_dev_major = 0, owner_dev_minor = 0;
    int n = 0, after_owner = 0;
    while (n < MAX_REGIONS && fgets(line, sizeof line, maps) != NULL) {
        unsigned long lo, hi, major, minor, inode;
        char perms[8] = "";
        int name_at = 0;
        if (sscanf(line, "%lx-%lx %7s %*s %lx:%lx %lu %n", &lo, &hi, perms, &major, &minor,
                   &inode, &name_at) < 6) {
            continue;
        }
        int named = name_at > 0 && line[name_at] != '\0' && line[name_at] != '\n';
        int heap = named && strncmp(line + name_at, "[heap]", 6) == 0;
        if (lo <= code && code < hi && inode != 0) {
            owner_inode = inode;
            owner_dev_major = major;
            owner_dev_minor = minor;
            owner[0] = 1;
        }
        int mine = owner[0] && inode == owner_inode && major == owner_dev_major
            && minor == owner_dev_minor;
        int bss = inode == 0 && !named && after_owner;
        after_owner = mine;
        if (perms[0] == 'r' && perms[1] == 'w' && perms[3] == 'p') {
            regions[n].lo = lo;
            regions[n].hi = hi;
            regions[n].allocator = mine || (bss && n > 0 && regions[n - 1].hi == lo);
            regions[n].anonymous = inode == 0 && (!named || heap);
            n++;
        }
    }
    fclose(maps);
    return n;
}

static const struct region *
region_holding(const struct region *regions, int n, uintptr_t at)
{
    int lo = 0, hi = n;
    while (lo < hi) {
        int mid = (lo + hi) / 2;
        if (regions[mid].hi <= at) {
            lo = mid + 1;
        }
        else {
            hi = mid;
        }
    }
    return (lo < n && regions[lo].lo <= at) ? &regions[lo] : NULL;
}

/* Where the allocator keeps its pointer to the vector of arena records, once found. */
static const uintptr_t *records_home = NULL;

/* The allocator's vector of arena records, as `find_records` found it. */
struct records {
    char *vector;
    uintptr_t end;                /* the end of the mapping that holds the vector */
    uintptr_t home_lo, home_hi;   /* the allocator's static data around `records_home` */
};

/* The vector `*home` points at, if it holds the record of every known arena. */
static char *
records_at(const uintptr_t *home, const struct region *regions, int n, uintptr_t *end)
{
    uintptr_t value = *home;
    if (value == 0 || (value & 7)) {
        return NULL;
    }
    const struct region *holder = region_holding(regions, n, value);
    if (holder == NULL || holder->allocator || !holder->anonymous
            || !vector_fits((char *)value, holder->lo, holder->hi)) {
        return NULL;
    }
    *end = holder->hi;
    return (char *)value;
}

/* The allocator's static data that holds `records_home`: its mapping and the mappings
 * of the allocator's file right before and after it (data and bss may be split). */
static void
home_span(const struct region *regions, int n, struct records *found)
{
    const struct region *at = region_holding(regions, n, (uintptr_t)records_home);
    int i = (int)(at - regions), lo = i, hi = i;
    while (lo > 0 && regions[lo - 1].allocator && regions[lo - 1].hi == regions[lo].lo) {
        lo--;
    }
    while (hi + 1 < n && regions[hi + 1].allocator && regions[hi + 1].lo == regions[hi].hi) {
        hi++;
    }
    found->home_lo = regions[lo].lo;
    found->home_hi = regions[hi].hi;
}

/* The allocator's vector of arena records, read through the pointer to it that the
 * allocator keeps in its static data (the data and bss of the file that holds its code):
 * a word there that points at anonymous memory holding the record of every known arena.
 * Looking there, and not for copies of a record anywhere, can only find the live vector,
 * never a copy that a realloc left behind; the vector moves when it grows, so it is
 * read through that word each time. 0 if no word fits. */
static int
find_records(size_t page, unsigned char *resident, size_t resident_len,
             struct records *found)
{
    static struct region regions[MAX_REGIONS];
    int n = load_regions(regions);
    if (records_home != NULL && region_holding(regions, n, (uintptr_t)records_home) != NULL) {
        found->vector = records_at(records_home, regions, n, &found->end);
        if (found->vector != NULL) {
            home_span(regions, n, found);
            return 1;
        }
    }
    records_home = NULL;
    for (int r = 0; r < n; r++) {
        uintptr_t lo = regions[r].lo, hi = regions[r].hi;
        if (!regions[r].allocator || (hi - lo) / page > resident_len
                || mincore((void *)lo, hi - lo, resident) != 0) {
            continue;
        }
        for (size_t p = 0; p < (hi - lo) / page; p++) {
            if (!(resident[p] & 1)) {
                continue;
            }
            const uintptr_t *word = (const uintptr_t *)(lo + p * page);
            for (size_t w = 0; w < page / sizeof(uintptr_t); w++) {
                found->vector = records_at(&word[w], regions, n, &found->end);
                if (found->vector != NULL) {
                    records_home = &word[w];
                    home_span(regions, n, found);
                    return 1;
                }
            }
        }
    }
    return 0;
}

/* mincore's answer for up to 64 arenas' worth of pages (the static data searched, or
 * one arena): one buffer, as everything here runs with the GIL held. */
static unsigned char resident_pages[64 * ARENA_SIZE / MIN_PAGE];

/* The allocator's records, into `found`; 0 if not installed, no arena is known yet, or
 * they are not found. */
static int
records_now(struct records *found)
{
    return installed && n_arenas > 0
        && find_records((size_t)sysconf(_SC_PAGESIZE), resident_pages,
                        sizeof resident_pages, found);
}

/* The end of the arena's last pool in use, or retired (see "retired pools": its header
 * reads as zeros); its first pool's address if there is none. */
static uintptr_t
end_of_use(const struct arena_record *record)
{
    uintptr_t first = (record->address + POOL_SIZE - 1) & ~(POOL_SIZE - 1);
    uintptr_t top = (uintptr_t)record->pool_address;
    while (top > first) {
        const struct pool_header *below = (const struct pool_header *)(top - POOL_SIZE);
        if (below->ref.count != 0 || header_is_blank(below)) {
            break;
        }
        top -= POOL_SIZE;
    }
    return top;
}

/* Whether the arena has empty pools above its last pool in use or retired (and such a
 * pool). */
static int
has_tail(const struct arena_record *record)
{
    uintptr_t first = (record->address + POOL_SIZE - 1) & ~(POOL_SIZE - 1);
    uintptr_t top = end_of_use(record);
    return top != first && top != (uintptr_t)record->pool_address;
}

/* The arena's list of empty pools, into `listed` (their number: at most MAX_POOLS), if
 * each is in the arena's carved part, aligned, empty and of this arena, and they add up
 * with the pools never carved to its count of free pools; -1 if not. */
static int
read_free_list(const struct arena_record *record, struct pool_header **listed)
{
    uintptr_t base = record->address;
    uintptr_t first = (base + POOL_SIZE - 1) & ~(POOL_SIZE - 1);
    uintptr_t carved = (uintptr_t)record->pool_address;
    unsigned int arenaindex = first_pool_index(base);
    unsigned int n = 0;
    for (struct pool_header *pool = record->freepools; pool != NULL; pool = pool->nextpool) {
        uintptr_t at = (uintptr_t)pool;
        if (n == MAX_POOLS || at < first || at >= carved || (at & (POOL_SIZE - 1))
                || pool->ref.count != 0 || pool->arenaindex != arenaindex) {
            return -1;
        }
        listed[n++] = pool;
    }
    unsigned int never_carved =
        (unsigned int)((first + (uintptr_t)pools_in(base) * POOL_SIZE - carved) / POOL_SIZE);
    return n + never_carved == record->nfreepools ? (int)n : -1;
}

/* Sorts pools by address: the allocator takes the first of its list first. */
static void
sort_pools(struct pool_header **pools, unsigned int n)
{
    for (unsigned int i = 1; i < n; i++) {
        struct pool_header *pool = pools[i];
        unsigned int j = i;
        for (; j > 0 && pools[j - 1] > pool; j--) {
            pools[j] = pools[j - 1];
        }
        pools[j] = pool;
    }
}

/* Give back the empty pools above the last pool in use of one arena; bytes given back
 * (resident before), or -1 if its record or list does not read as expected. */
static Py_ssize_t
give_back_tail(struct arena_record *record, size_t page, unsigned char *resident)
{
    uintptr_t base = record->address;
    uintptr_t first = (base + POOL_SIZE - 1) & ~(POOL_SIZE - 1);
    uintptr_t carved = (uintptr_t)record->pool_address;
    uintptr_t top = end_of_use(record);
    if (top == carved || top == first) {
        return 0;  /* nothing above the last pool in use, or no pool in use at all */
    }
    struct pool_header *kept[MAX_POOLS];
    int n_listed = read_free_list(record, kept);
    if (n_listed < 0) {
        return -1;
    }
    unsigned int n_kept = 0;
    for (int i = 0; i < n_listed; i++) {
        if ((uintptr_t)kept[i] < top) {
            kept[n_kept++] = kept[i];
        }
    }
    if ((unsigned int)n_listed - n_kept != (unsigned int)((carved - top) / POOL_SIZE)) {
        return -1;
    }
    if (mincore((void *)top, carved - top, resident) != 0) {
        return -1;
    }
    Py_ssize_t tail = 0;
    for (size_t i = 0; i < (carved - top) / page; i++) {
        tail += (resident[i] & 1) ? (Py_ssize_t)page : 0;
    }
    sort_pools(kept, n_kept);  /* the allocator then takes the lowest first */
    for (unsigned int i = 0; i + 1 < n_kept; i++) {
        kept[i]->nextpool = kept[i + 1];
    }
    if (n_kept > 0) {
        kept[n_kept - 1]->nextpool = NULL;
    }
    record->freepools = n_kept > 0 ? kept[0] : NULL;
    record->pool_address = (char *)top;
    if (madvise((void *)top, carved - top, MADV_DONTNEED) != 0) {
        return 0;  /* still sound: the pools are only carved again */
    }
    return tail;
}

/* ------------------------------------------------------------------ retired pools
 *
 * What a tail leaves is the empty pools below an arena's last pool in use: each keeps
 * its header page, since the arena's list of empty pools runs through them. Taking such
 * a pool out of that list means the arena has one free pool less, and that count orders
 * the allocator's list of arenas that have free pools (`usable_arenas`, the fullest
 * first, so that the emptiest can empty out and go back), indexed by the last arena with
 * each count (`nfp2lasta`). `retire_pools` takes an arena's listed pools out (all but
 * its first pool, whose header names the arena's index), takes their number off both its
 * count of free pools and its count of pools, moves the arena in the list as the
 * allocator itself moves an arena whose count changed (out of it if no free pool is
 * left), and drops the pools whole. The arena keeps them, unused, until its last pool
 * in use is emptied: with its counts equal, the allocator frees the whole arena as it
 * frees any other. The list's head and index are statics of the allocator next to its
 * pointer to the vector: they are found (and checked on each call) as the words within
 * LIST_WINDOW bytes of it that hold the head of the list and the index that the list's
 * records themselves give, each exactly once. The list is walked and checked first:
 * every record in the vector, linked both ways, sorted by count, holding every known
 * arena with a free pool. If anything does not fit, nothing is written.
 */
#define LIST_SLOTS (MAX_POOLS + 1)
#define LIST_WINDOW 2048

struct arena_list {
    struct arena_record **head;       /* usable_arenas */
    struct arena_record **last_with;  /* nfp2lasta: the last arena with each count */
};

static struct arena_list list_home = {NULL, NULL};

static int
is_record(const struct records *found, const struct arena_record *at)
{
    uintptr_t p = (uintptr_t)at, vector = (uintptr_t)found->vector;
    return p >= vector && p + sizeof *at <= found->end
        && (p - vector) % sizeof *at == 0;
}

/* The head of the allocator's list of arenas with free pools, reached from a known
 * arena's record, with `last_with` set as its records give it; NULL if it does not
 * check out (see above), or no known arena has a free pool. */
static struct arena_record *
read_list(const struct records *found, struct arena_record **last_with)
{
    struct arena_record *start = NULL;
    for (size_t i = 0; i < n_arenas; i++) {
        if (!is_arena((uintptr_t)arenas[i].address)) {
            continue;
        }
        struct arena_record *record = record_of(found->vector, &arenas[i]);
        if (record == NULL) {
            return NULL;
        }
        if (record->nfreepools == 0) {
            continue;
        }
        struct arena_record *prev = record->prevarena;
        if (prev != NULL && (!is_record(found, prev) || prev->nextarena != record)) {
            return NULL;
        }
        start = record;
    }
    if (start == NULL) {
        return NULL;
    }
    size_t limit = (found->end - (uintptr_t)found->vector) / sizeof(struct arena_record);
    struct arena_record *head = start;
    for (size_t steps = 0; head->prevarena != NULL; steps++) {
        struct arena_record *prev = head->prevarena;
        if (steps == limit || !is_record(found, prev) || prev->nextarena != head) {
            return NULL;
        }
        head = prev;
    }
    for (size_t i = 0; i < n_arenas; i++) {  /* no other known arena heads a list */
        if (is_arena((uintptr_t)arenas[i].address)) {
            struct arena_record *record = record_of(found->vector, &arenas[i]);
            if (record->nfreepools > 0 && record->prevarena == NULL && record != head) {
                return NULL;
            }
        }
    }
    memset(last_with, 0, LIST_SLOTS * sizeof *last_with);
    unsigned int count = 1;
    size_t steps = 0;
    for (struct arena_record *at = head; at != NULL; at = at->nextarena) {
        struct arena_record *next = at->nextarena;
        if (steps++ == limit || at->address == 0 || at->nfreepools < count
                || at->nfreepools > at->ntotalpools || at->ntotalpools > MAX_POOLS
                || (next != NULL && (!is_record(found, next) || next->prevarena != at))) {
            return NULL;
        }
        count = at->nfreepools;
        last_with[count] = at;
    }
    return head;
}

/* Whether `*home` and `last_with` hold what the list's records give. */
static int
list_is_at(const struct arena_list *home, struct arena_record *head,
           struct arena_record **last_with)
{
    return *home->head == head
        && memcmp(home->last_with, last_with, LIST_SLOTS * sizeof *last_with) == 0;
}

/* The allocator's list of arenas with free pools, into `list`; 0 if not found. */
static int
find_list(const struct records *found, struct arena_list *list)
{
    struct arena_record *last_with[LIST_SLOTS];
    struct arena_record *head = read_list(found, last_with);
    if (head == NULL) {
        return 0;
    }
    if (list_home.head != NULL && list_is_at(&list_home, head, last_with)) {
        *list = list_home;
        return 1;
    }
    list_home.head = list_home.last_with = NULL;
    uintptr_t home = (uintptr_t)records_home;
    uintptr_t lo = home - found->home_lo > LIST_WINDOW ? home - LIST_WINDOW : found->home_lo;
    uintptr_t hi = found->home_hi - home > LIST_WINDOW ? home + LIST_WINDOW : found->home_hi;
    lo = (lo + 7) & ~(uintptr_t)7;
    struct arena_list at = {NULL, NULL};
    int heads = 0, indexes = 0;
    for (uintptr_t w = lo; w + sizeof last_with <= hi; w += sizeof(uintptr_t)) {
        if (memcmp((void *)w, last_with, sizeof last_with) == 0) {
            at.last_with = (struct arena_record **)w;
            indexes++;
        }
    }
    if (indexes != 1) {
        return 0;
    }
    uintptr_t index_lo = (uintptr_t)at.last_with, index_hi = index_lo + sizeof last_with;
    for (uintptr_t w = lo; w + sizeof(uintptr_t) <= hi; w += sizeof(uintptr_t)) {
        /* the pointer to the vector is the head's address too when the head is the
         * vector's first record */
        if ((w < index_lo || w >= index_hi) && w != home
                && *(struct arena_record **)w == head) {
            at.head = (struct arena_record **)w;
            heads++;
        }
    }
    if (heads != 1) {
        return 0;
    }
    list_home = *list = at;
    return 1;
}

/* Moves `arena` in the list to where its new count of free pools puts it, as the
 * allocator moves one (after the last arena with at most as many; out if none left). */
static void
recount(const struct arena_list *list, struct arena_record *arena, unsigned int count)
{
    struct arena_record *prev = arena->prevarena, *next = arena->nextarena;
    if (list->last_with[arena->nfreepools] == arena) {
        list->last_with[arena->nfreepools] =
            (prev != NULL && prev->nfreepools == arena->nfreepools) ? prev : NULL;
    }
    if (prev != NULL) {
        prev->nextarena = next;
    }
    else {
        *list->head = next;
    }
    if (next != NULL) {
        next->prevarena = prev;
    }
    arena->nfreepools = count;
    if (count == 0) {
        return;  /* wholly in use: out of the list, as the allocator leaves such arenas */
    }
    struct arena_record *after = NULL;
    for (unsigned int c = count; c > 0 && after == NULL; c--) {
        after = list->last_with[c];
    }
    arena->prevarena = after;
    arena->nextarena = after != NULL ? after->nextarena : *list->head;
    if (arena->nextarena != NULL) {
        arena->nextarena->prevarena = arena;
    }
    if (after != NULL) {
        after->nextarena = arena;
    }
    else {
        *list->head = arena;
    }
    list->last_with[count] = arena;
}

/* The arena's listed empty pools that `retire_arena` would take out: those below its
 * last pool in use (those above are its tail), but its first pool. Into `retired` (their
 * number), the rest of the list into `kept` (*n_kept); -1 if the list does not read as
 * expected. */
static int
retirable(const struct arena_record *record, struct pool_header **retired,
          struct pool_header **kept, unsigned int *n_kept)
{
    uintptr_t first = (record->address + POOL_SIZE - 1) & ~(POOL_SIZE - 1);
    if (record->freepools == NULL || record->nfreepools == record->ntotalpools) {
        return 0;  /* no pool in use: the allocator frees such an arena itself */
    }
    uintptr_t top = end_of_use(record);
    int n_listed = read_free_list(record, kept);
    if (n_listed < 0) {
        return -1;
    }
    unsigned int n = 0;
    *n_kept = 0;
    for (int i = 0; i < n_listed; i++) {
        uintptr_t at = (uintptr_t)kept[i];
        if (at == first || at >= top) {
            kept[(*n_kept)++] = kept[i];
        }
        else {
            retired[n++] = kept[i];
        }
    }
    sort_pools(retired, n);
    /* An arena of one pool is never left: each time its pool came free, the allocator
     * would take it for a wholly empty arena (one free pool of one) and unlink it from
     * the list through the links it left when the pool was taken. */
    if (n > 0 && record->ntotalpools - n < 2) {
        kept[(*n_kept)++] = retired[--n];
    }
    return (int)n;
}

/* Takes the `retirable` pools of one arena out of it and drops them whole; bytes given
 * back (resident before), or -1 if they cannot be read. */
static Py_ssize_t
retire_arena(struct tracked *arena, struct arena_record *record,
             const struct arena_list *list, struct pool_header **retired, unsigned int n,
             struct pool_header **kept, unsigned int n_kept, size_t page,
             unsigned char *resident)
{
    uintptr_t first = (record->address + POOL_SIZE - 1) & ~(POOL_SIZE - 1);
    uintptr_t carved = (uintptr_t)record->pool_address;
    if (mincore((void *)first, carved - first, resident) != 0) {
        return -1;
    }
    sort_pools(kept, n_kept);  /* the allocator then takes the lowest first */
    for (unsigned int i = 0; i < n_kept; i++) {
        kept[i]->nextpool = i + 1 < n_kept ? kept[i + 1] : NULL;
    }
    record->freepools = n_kept > 0 ? kept[0] : NULL;
    recount(list, record, record->nfreepools - n);
    record->ntotalpools -= n;
    arena->retired += n;
    Py_ssize_t given = 0;
    for (unsigned int i = 0; i < n;) {
        unsigned int j = i + 1;  /* a run of adjacent pools: one system call */
        while (j < n && (uintptr_t)retired[j] == (uintptr_t)retired[j - 1] + POOL_SIZE) {
            j++;
        }
        uintptr_t from = (uintptr_t)retired[i], to = (uintptr_t)retired[j - 1] + POOL_SIZE;
        Py_ssize_t run = 0;
        for (uintptr_t p = from; p < to; p += page) {
            run += (resident[(p - first) / page] & 1) ? (Py_ssize_t)page : 0;
        }
        if (madvise((void *)from, to - from, MADV_DONTNEED) == 0) {
            given += run;
        }
        i = j;
    }
    return given;
}
#endif

PyDoc_STRVAR(give_back_tails_doc,
"give_back_tails(max_arenas=-1) -> (int, bool)\n\n"
"Give back whole the empty pools above the last pool in use of each arena known since\n"
"`install` (header page included): the arena takes them as pools it never used. At most\n"
"max_arenas arenas are done (negative: no limit; about 40 us one with a 1 MiB tail).\n"
"(Bytes given back, whether every such tail is given back now.) Nothing is given back\n"
"where the allocator's arena records cannot be found and checked.");

static PyObject *
give_back_tails(PyObject *module, PyObject *args)
{
    Py_ssize_t budget = -1;
    if (!PyArg_ParseTuple(args, "|n:give_back_tails", &budget)) {
        return NULL;
    }
    Py_ssize_t released = 0;
    int done = 1;
#if POOL_PAGES
    size_t page = (size_t)sysconf(_SC_PAGESIZE);  /* checked by install() */
    struct records found;
    char *records = records_now(&found) ? found.vector : NULL;
    for (size_t i = 0; records != NULL && i < n_arenas; i++) {
        if (!is_arena((uintptr_t)arenas[i].address)) {
            continue;  /* as find_records passed it over */
        }
        struct arena_record *record = record_of(records, &arenas[i]);
        if (record == NULL) {
            break;  /* find_records checked them all: only if the allocator changed */
        }
        if (!has_tail(record)) {
            continue;
        }
        if (budget == 0) {
            done = 0;
            break;
        }
        budget--;
        Py_ssize_t got = give_back_tail(record, page, resident_pages);
        if (got > 0) {
            released += got;
        }
    }
#endif
    return Py_BuildValue("(nO)", released, done ? Py_True : Py_False);
}

PyDoc_STRVAR(retire_pools_doc,
"retire_pools(max_arenas=-1) -> (int, bool)\n\n"
"Take the empty pools below the last pool in use of each arena known since `install`\n"
"(all but the arena's first pool) out of the arena and give them back whole: the arena\n"
"then counts that many pools less, and the allocator frees it once its pools in use are\n"
"empty. At most max_arenas arenas are done (negative: no limit). (Bytes given back,\n"
"whether every such pool is given back now.) Nothing is given back where the\n"
"allocator's arena records and its list of arenas cannot be found and checked, nor in\n"
"a debug build of CPython.");

static PyObject *
retire_pools(PyObject *module, PyObject *args)
{
    Py_ssize_t budget = -1;
    if (!PyArg_ParseTuple(args, "|n:retire_pools", &budget)) {
        return NULL;
    }
    Py_ssize_t released = 0;
    int done = 1;
    /* Not in a debug build of CPython: its allocator statistics assert that every empty
     * pool below the carving point is on its arena's list. */
#if POOL_PAGES && !defined(Py_DEBUG)
    size_t page = (size_t)sysconf(_SC_PAGESIZE);  /* checked by install() */
    struct records found;
    struct arena_list list;
    if (!records_now(&found) || !find_list(&found, &list)) {
        return Py_BuildValue("(nO)", released, Py_True);
    }
    for (size_t i = 0; i < n_arenas; i++) {
        if (!is_arena((uintptr_t)arenas[i].address)) {
            continue;
        }
        struct arena_record *record = record_of(found.vector, &arenas[i]);
        if (record == NULL) {
            break;  /* find_records checked them all: only if the allocator changed */
        }
        struct pool_header *retired[MAX_POOLS], *kept[MAX_POOLS];
        unsigned int n_kept = 0;
        int n = retirable(record, retired, kept, &n_kept);
        if (n <= 0) {
            continue;  /* nothing to take out, or a list that does not read as expected */
        }
        if (budget == 0) {
            done = 0;
            break;
        }
        budget--;
        Py_ssize_t got = retire_arena(&arenas[i], record, &list, retired, (unsigned int)n,
                                      kept, n_kept, page, resident_pages);
        if (got > 0) {
            released += got;
        }
    }
#endif
    return Py_BuildValue("(nO)", released, done ? Py_True : Py_False);
}

PyDoc_STRVAR(layout_found_doc,
"layout_found() -> (bool, bool)\n\n"
"Whether the allocator's vector of arena records, and its list of arenas with free\n"
"pools (checked through), are found now: what `give_back_tails` and `retire_pools` need.");

static PyObject *
layout_found(PyObject *module, PyObject *unused)
{
    int records = 0, list = 0;
#if POOL_PAGES
    struct records found;
    struct arena_list at;
    records = records_now(&found);
    list = records && find_list(&found, &at);
#endif
    return Py_BuildValue("(OO)", records ? Py_True : Py_False, list ? Py_True : Py_False);
}

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
    size_t page = (size_t)sysconf(_SC_PAGESIZE);  /* checked by install() */
    unsigned char resident[ARENA_SIZE / MIN_PAGE];
    if (installed) {
        for (size_t i = 0; i < n_arenas && budget != 0; i++) {
            Py_ssize_t got = release_arena((uintptr_t)arenas[i].address, page, resident, &budget);
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
    {"give_back_tails", give_back_tails, METH_VARARGS, give_back_tails_doc},
    {"retire_pools", retire_pools, METH_VARARGS, retire_pools_doc},
    {"layout_found", layout_found, METH_NOARGS, layout_found_doc},
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
