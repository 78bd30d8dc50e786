# cython: language_level=3, boundscheck=False, wraparound=False
"""fsync threads that never take the GIL: store.commit.SyncWorkers' compiled twin.

Python worker threads need the GIL after every fdatasync (to hand the completion to the loop and
to wait for the next job). On a busy 2-core gateway that was ~19 futex calls per fsync round and
~1,000 forced GIL switches per second of the event loop's thread (docs/performance-history.md).
Here the workers are plain pthreads: a job is a list of fds (and optionally a directory to
fsync); a finished job goes on a done list and, if that list was empty, bumps an eventfd the
event loop watches. The loop reads the eventfd, takes the whole done list under the mutex and
runs the callbacks itself, so completions cost no thread switch on the Python side at all.
"""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_GET_SIZE
from libc.stdlib cimport free, malloc
from libc.string cimport memcpy

import os

cdef extern from *:
    """
    #include <errno.h>
    #include <fcntl.h>
    #include <pthread.h>
    #include <signal.h>
    #include <stdint.h>
    #include <stdlib.h>
    #include <string.h>
    #include <sys/eventfd.h>
    #include <unistd.h>

    #define LG_MAX_THREADS 16

    typedef struct lg_job {
        struct lg_job *next;
        long long id;
        int err;
        int nfds;
        char *dir;   /* NUL-terminated path to fsync after the fds, or NULL */
        int fds[1];  /* nfds of them (allocated past the struct) */
    } lg_job;

    typedef struct {
        pthread_mutex_t mu;
        pthread_cond_t cv;
        lg_job *todo_head, *todo_tail, *done_head, *done_tail;
        int stop, nthreads, started, efd;
        pthread_t threads[LG_MAX_THREADS];
    } lg_pool;

    static void lg_run(lg_job *j) {
        int err = 0;
        for (int i = 0; i < j->nfds && !err; i++) {
            if (fdatasync(j->fds[i]) != 0) err = errno;
        }
        if (!err && j->dir != NULL) {
            int d = open(j->dir, O_RDONLY | O_CLOEXEC);
            if (d < 0) {
                err = errno;
            } else {
                if (fsync(d) != 0) err = errno;
                close(d);
            }
        }
        j->err = err;
    }

    static void *lg_worker(void *arg) {
        lg_pool *p = (lg_pool *)arg;
        sigset_t all;
        sigfillset(&all);
        pthread_sigmask(SIG_BLOCK, &all, NULL);  /* signals are the event loop's business */
        for (;;) {
            pthread_mutex_lock(&p->mu);
            while (p->todo_head == NULL && !p->stop) pthread_cond_wait(&p->cv, &p->mu);
            lg_job *j = p->todo_head;
            if (j == NULL) {  /* stopping and nothing left to do */
                pthread_mutex_unlock(&p->mu);
                return NULL;
            }
            p->todo_head = j->next;
            if (p->todo_head == NULL) p->todo_tail = NULL;
            pthread_mutex_unlock(&p->mu);
            lg_run(j);
            j->next = NULL;
            pthread_mutex_lock(&p->mu);
            int was_empty = p->done_head == NULL;
            if (p->done_tail != NULL) p->done_tail->next = j; else p->done_head = j;
            p->done_tail = j;
            pthread_mutex_unlock(&p->mu);
            /* The loop reads the eventfd before it takes the list: a job that finds the list
               non-empty is taken along with the one that signalled. */
            if (was_empty) {
                uint64_t one = 1;
                ssize_t r = write(p->efd, &one, sizeof one);
                (void)r;
            }
        }
    }

    static int lg_start(lg_pool *p) {
        p->started = 0;
        p->stop = 0;
        for (int i = 0; i < p->nthreads; i++) {
            int rc = pthread_create(&p->threads[i], NULL, lg_worker, p);  /* returns the error */
            if (rc != 0) return rc;
            p->started++;
        }
        return 0;
    }

    static void lg_push(lg_pool *p, lg_job *j) {
        j->next = NULL;
        pthread_mutex_lock(&p->mu);
        if (p->todo_tail != NULL) p->todo_tail->next = j; else p->todo_head = j;
        p->todo_tail = j;
        pthread_cond_signal(&p->cv);
        pthread_mutex_unlock(&p->mu);
    }

    static lg_job *lg_take_done(lg_pool *p) {
        uint64_t n;
        ssize_t r = read(p->efd, &n, sizeof n);  /* reset first (non-blocking) */
        (void)r;
        pthread_mutex_lock(&p->mu);
        lg_job *j = p->done_head;
        p->done_head = p->done_tail = NULL;
        pthread_mutex_unlock(&p->mu);
        return j;
    }

    static void lg_stop(lg_pool *p) {
        pthread_mutex_lock(&p->mu);
        p->stop = 1;
        pthread_cond_broadcast(&p->cv);
        pthread_mutex_unlock(&p->mu);
        for (int i = 0; i < p->started; i++) pthread_join(p->threads[i], NULL);
        p->started = 0;
        p->stop = 0;
    }

    static void lg_free_list(lg_job *j) {
        while (j != NULL) {
            lg_job *next = j->next;
            free(j->dir);
            free(j);
            j = next;
        }
    }

    static int lg_init(lg_pool *p, int n) {
        memset(p, 0, sizeof *p);
        p->nthreads = n < 1 ? 1 : (n > LG_MAX_THREADS ? LG_MAX_THREADS : n);
        pthread_mutex_init(&p->mu, NULL);
        pthread_cond_init(&p->cv, NULL);
        p->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
        return p->efd < 0 ? errno : 0;
    }

    /* A fork child inherits the lists and maybe a locked mutex but none of the threads. */
    static void lg_after_fork(lg_pool *p) {
        pthread_mutex_init(&p->mu, NULL);
        pthread_cond_init(&p->cv, NULL);
        lg_free_list(p->todo_head);
        lg_free_list(p->done_head);
        p->todo_head = p->todo_tail = p->done_head = p->done_tail = NULL;
        p->started = 0;
        p->stop = 0;
    }
    """
    ctypedef struct lg_job:
        lg_job *next
        long long id
        int err
        int nfds
        char *dir
        int fds[1]

    ctypedef struct lg_pool:
        int started
        int efd

    int lg_init(lg_pool *p, int n)
    int lg_start(lg_pool *p) nogil
    void lg_push(lg_pool *p, lg_job *j) nogil
    lg_job *lg_take_done(lg_pool *p) nogil
    void lg_stop(lg_pool *p) nogil
    void lg_free_list(lg_job *j)
    void lg_after_fork(lg_pool *p)
    int close(int fd)


cdef class FsyncPool:
    """`n` pthreads that fdatasync; `take_done()` after the eventfd (`fileno()`) is readable."""

    cdef lg_pool pool
    cdef bint ready

    def __cinit__(self, int n):
        self.ready = False
        err = lg_init(&self.pool, n)
        if err:
            raise OSError(err, os.strerror(err))
        self.ready = True

    def fileno(self) -> int:
        return self.pool.efd

    def submit(self, long long job_id, fds, directory) -> None:
        """fdatasync every fd of `fds`, then fsync `directory` (bytes path) unless None; stops
        at the first error. The threads start on the first job (and again after `forked`)."""
        cdef Py_ssize_t i, n = len(fds)
        cdef lg_job *j
        cdef Py_ssize_t dlen
        cdef int err
        cdef list ints = [int(fd) for fd in fds]  # any conversion error before the malloc
        if directory is not None and not isinstance(directory, bytes):
            raise TypeError("directory must be bytes or None")
        if not self.pool.started:
            with nogil:
                err = lg_start(&self.pool)
            if err:
                with nogil:
                    lg_stop(&self.pool)
                raise OSError(err, os.strerror(err))
        j = <lg_job *>malloc(sizeof(lg_job) + (n if n > 0 else 1) * sizeof(int))
        if j == NULL:
            raise MemoryError()
        j.next = NULL
        j.id = job_id
        j.err = 0
        j.nfds = <int>n
        j.dir = NULL
        for i in range(n):
            j.fds[i] = <int>ints[i]
        if directory is not None:
            dlen = PyBytes_GET_SIZE(directory)
            j.dir = <char *>malloc(dlen + 1)
            if j.dir == NULL:
                free(j)
                raise MemoryError()
            memcpy(j.dir, PyBytes_AS_STRING(directory), dlen)
            j.dir[dlen] = 0
        with nogil:
            lg_push(&self.pool, j)

    def take_done(self) -> list:
        """[(job id, errno or 0)] of the jobs finished since the last call, in finishing order."""
        cdef lg_job *j
        cdef lg_job *head
        out = []
        with nogil:
            head = lg_take_done(&self.pool)
        j = head
        while j != NULL:
            out.append((j.id, j.err))
            j = j.next
        lg_free_list(head)
        return out

    def shutdown(self) -> None:
        """Finish the queued jobs and join the threads (a later submit starts them again)."""
        if self.pool.started:
            with nogil:
                lg_stop(&self.pool)

    def forked(self) -> None:
        """In a fork child (os.register_at_fork): none of the threads came along; forget them
        and the jobs, so the next submit starts threads of this process."""
        lg_after_fork(&self.pool)

    def __dealloc__(self):
        if not self.ready:
            return
        if self.pool.started:
            with nogil:
                lg_stop(&self.pool)
        lg_free_list(lg_take_done(&self.pool))
        close(self.pool.efd)
