/* pddnet.transport.wan._mover: the WAN data path's system calls on a native thread.
 *
 * A Mover owns one POSIX thread with its own epoll instance. Python queues an
 * *operation* on a non-blocking socket: write these buffers in order (a gather
 * write), or fill this buffer exactly. Each call first tries the operation on
 * the calling thread (GIL released), so a socket that has room, or data
 * queued, costs no hand-off at all. What is left goes to the thread, which
 * waits for the socket in its own epoll and does the rest of the system calls
 * without the GIL. A finished operation is put on a completion list and the
 * Mover's eventfd (fileno()) becomes readable; Python drains the list with
 * completions().
 *
 * So the Python side (trio) wakes once per finished operation (one per
 * chunk), however many times the kernel woke the thread for room or data.
 *
 * Rules that keep it safe:
 * - The thread touches an operation only while it is linked in the active
 *   list, and marks it busy (mu released) for the length of its system calls.
 *   cancel() and cancel_fd() wait until it is not busy, then unlink it: once
 *   they return, not one more byte is read into, or written from, its
 *   buffers. A receiver relies on this to revoke a grant's blocks.
 * - Buffers are held (PyObject_GetBuffer) from start to release, and released
 *   only by the thread that holds the GIL: in completions(), cancel*() and
 *   close().
 * - A socket must not be closed while an operation on it is active: call
 *   cancel_fd(fd) first (pddnet's close helper does).
 * - At most one operation per socket and direction at a time (a read and a
 *   write may wait together: the second registers a duplicate descriptor).
 *
 * Status codes in completions(): 0 done, -1 end of stream (the peer closed
 * while a receive wanted more), or a positive errno.
 *
 * Checksums: a receive may carry an Xxh3 digest, which the thread updates with
 * each read's bytes right after the read, while they are still in cache (a
 * second pass over a 4 MiB chunk after the last read runs at half the speed
 * or less). The XXH3 code is python-xxhash's own (a dependency of pddnet):
 * bind_xxh3() resolves its exported functions from that extension, so the
 * digest is the one xxhash.xxh3_64 computes. An Xxh3 in use by an operation
 * refuses update() and intdigest() until the operation has ended.
 *
 * A send may carry one too: the thread hashes each write's bytes (those at
 * stream offset hash_from and on) right after the write, while the kernel's
 * copy has left them in cache, and appends the digest as an 8-byte
 * little-endian trailer once every buffer is written (the chunk trailer of
 * docs/wire.md). Under memory contention a cold pass before the write cost
 * 2-3x as much as this one (docs/wan.md).
 *
 * A send with room set finishes only once every byte is written *and* the
 * socket has room again (POLLOUT: under its TCP_NOTSENT_LOWAT mark): the
 * writer's next step is to wait for that room, and the thread waits for it
 * instead, so Python wakes once per chunk rather than twice (docs/wan.md).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#define K_IOV_MAX 512 /* iovecs per sendmsg, well under Linux's 1024 */
#define K_EVENTS 64
#define K_EOF (-1)
#define K_PENDING 1
#define K_DONE 0

enum { OP_SEND = 1, OP_RECV = 2 };

/* ---- XXH3, resolved from python-xxhash's extension by bind_xxh3() ---- */

static void *(*xxh3_create)(void);
static int (*xxh3_free)(void *);
static int (*xxh3_reset)(void *);
static int (*xxh3_update)(void *, const void *, size_t);
static unsigned long long (*xxh3_digest)(const void *);

typedef struct {
    PyObject_HEAD
    void *state;
    int in_use; /* an operation holds it */
} Xxh3;

static PyTypeObject Xxh3Type;

typedef struct Op {
    struct Op *prev, *next;
    unsigned long long token;
    int fd;
    int kind;
    int busy;       /* the thread is in a system call on it (mu not held) */
    int cancelled;  /* cancel() is waiting for it, or has taken it */
    int registered; /* fd (or efd) is in the thread's epoll for this operation */
    int efd;        /* a duplicate of fd registered instead, or -1 (see arm) */
    int status;     /* K_DONE, K_EOF or an errno, once finished */
    Py_ssize_t done, total;
    int lowat, lowat_cap; /* receive: SO_RCVLOWAT as last set, and its cap */
    int niov, iov_i;
    struct iovec *iov;
    Py_buffer *views;
    int nviews;
    Xxh3 *digest; /* updated with every read, or every write from hash_from on */
    Py_ssize_t hash_from;      /* send: the first byte (stream offset) hashed */
    int trailer_set;           /* send: the trailer holds the digest */
    int room;                  /* send: finish only once the socket has room again */
    int room_wait;             /* send: all written, waiting for that room */
    unsigned char trailer[8];  /* send: the last iovec (the digest, little-endian) */
} Op;

typedef struct {
    PyObject_HEAD
    pthread_mutex_t mu;
    pthread_cond_t idle; /* broadcast when a cancelled operation stops being busy */
    int epfd, done_efd, stop_efd;
    pthread_t thread;
    pid_t pid; /* the process that started the thread (a forked child has none) */
    int running;
    Op *active;              /* doubly linked */
    Op *done_head, *done_tail; /* finished, not yet collected */
} Mover;

/* ---- lists (mu held) ---- */

static void unlink_active(Mover *m, Op *op) {
    if (op->prev) op->prev->next = op->next;
    else m->active = op->next;
    if (op->next) op->next->prev = op->prev;
    op->prev = op->next = NULL;
}

static void push_active(Mover *m, Op *op) {
    op->prev = NULL;
    op->next = m->active;
    if (m->active) m->active->prev = op;
    m->active = op;
}

static void push_done(Mover *m, Op *op) {
    op->prev = op->next = NULL;
    if (m->done_tail) m->done_tail->next = op;
    else m->done_head = op;
    m->done_tail = op;
}

static Op *find_active(Mover *m, unsigned long long token) {
    for (Op *op = m->active; op; op = op->next)
        if (op->token == token) return op;
    return NULL;
}

/* ---- operations (no Python, no mu) ---- */

/* Run the operation's system calls until it is finished (K_DONE, K_EOF or an
 * errno) or the socket has no room or data (EAGAIN). A short write or read means
 * the socket is full or empty, so it stops there rather than retrying into EAGAIN. */
static void hash_written(Op *op, const char *p, size_t len, Py_ssize_t pos) {
    if (op->digest == NULL || op->trailer_set || pos + (Py_ssize_t)len <= op->hash_from) return;
    size_t skip = pos < op->hash_from ? (size_t)(op->hash_from - pos) : 0;
    xxh3_update(op->digest->state, p + skip, len - skip);
}

static int run_op(Op *op) {
    if (op->kind == OP_SEND) {
        while (op->iov_i < op->niov) {
            struct msghdr msg;
            memset(&msg, 0, sizeof msg);
            int n = op->niov - op->iov_i;
            if (op->digest && !op->trailer_set) {
                if (n == 1) { /* every buffer written: the trailer is the digest */
                    unsigned long long d = xxh3_digest(op->digest->state);
                    for (int i = 0; i < 8; i++) op->trailer[i] = (unsigned char)(d >> (8 * i));
                    op->trailer_set = 1;
                } else {
                    n--; /* not the trailer yet */
                }
            }
            msg.msg_iov = op->iov + op->iov_i;
            msg.msg_iovlen = n < K_IOV_MAX ? n : K_IOV_MAX;
            Py_ssize_t want = 0;
            for (size_t i = 0; i < msg.msg_iovlen; i++) want += (Py_ssize_t)msg.msg_iov[i].iov_len;
            ssize_t k = sendmsg(op->fd, &msg, MSG_DONTWAIT | MSG_NOSIGNAL);
            if (k < 0) {
                if (errno == EINTR) continue;
                return errno == EWOULDBLOCK ? EAGAIN : errno;
            }
            Py_ssize_t pos = op->done;
            op->done += k;
            Py_ssize_t left = k;
            while (left && op->iov_i < op->niov) {
                struct iovec *v = &op->iov[op->iov_i];
                size_t take = (size_t)left < v->iov_len ? (size_t)left : v->iov_len;
                hash_written(op, (const char *)v->iov_base, take, pos);
                pos += (Py_ssize_t)take;
                left -= (Py_ssize_t)take;
                if (take == v->iov_len) {
                    op->iov_i++;
                } else {
                    v->iov_base = (char *)v->iov_base + take;
                    v->iov_len -= take;
                }
            }
            /* skip empty buffers */
            while (op->iov_i < op->niov && op->iov[op->iov_i].iov_len == 0) op->iov_i++;
            if (k < want && op->iov_i < op->niov) return EAGAIN;
        }
        if (op->room && !op->room_wait) {
            /* POLLOUT is the same test as the epoll wake-up below */
            struct pollfd p = {.fd = op->fd, .events = POLLOUT};
            if (poll(&p, 1, 0) == 0) {
                op->room_wait = 1; /* the next wake-up (room, or an error) ends it */
                return EAGAIN;
            }
        }
        return K_DONE;
    }
    while (op->done < op->total) {
        char *p = (char *)op->views[0].buf + op->done;
        ssize_t k = recv(op->fd, p, (size_t)(op->total - op->done), MSG_DONTWAIT);
        if (k < 0) {
            if (errno == EINTR) continue;
            return errno == EWOULDBLOCK ? EAGAIN : errno;
        }
        if (k == 0) return K_EOF;
        if (op->digest) xxh3_update(op->digest->state, p, (size_t)k);
        op->done += k;
        if (op->done < op->total) return EAGAIN; /* took all that was queued */
    }
    return K_DONE;
}

/* Wait for the socket: set the receive low-water mark (only when it changes) so
 * that the thread wakes for a useful amount, then (re-)arm the one-shot epoll
 * registration. Returns 0 or an errno. */
static int arm(Mover *m, Op *op) {
    struct epoll_event ev;
    if (op->kind == OP_RECV) {
        Py_ssize_t left = op->total - op->done;
        int want = left < op->lowat_cap ? (int)left : op->lowat_cap;
        if (want < 1) want = 1;
        if (want != op->lowat) {
            if (setsockopt(op->fd, SOL_SOCKET, SO_RCVLOWAT, &want, sizeof want) < 0) return errno;
            op->lowat = want;
        }
    }
    memset(&ev, 0, sizeof ev);
    ev.events = (op->kind == OP_SEND ? EPOLLOUT : EPOLLIN) | EPOLLONESHOT;
    ev.data.u64 = op->token;
    int fd = op->efd >= 0 ? op->efd : op->fd;
    if (epoll_ctl(m->epfd, op->registered ? EPOLL_CTL_MOD : EPOLL_CTL_ADD, fd, &ev) < 0) {
        if (errno != EEXIST || op->registered) return errno;
        /* An operation in the other direction (a receiver's read beside a frame
         * it sends) has the socket registered: epoll keys a registration on the
         * descriptor, so this one registers a duplicate of it. */
        op->efd = fcntl(op->fd, F_DUPFD_CLOEXEC, 0);
        if (op->efd < 0) return errno;
        if (epoll_ctl(m->epfd, EPOLL_CTL_ADD, op->efd, &ev) < 0) {
            int e = errno;
            close(op->efd);
            op->efd = -1;
            return e;
        }
    }
    op->registered = 1;
    return 0;
}

static void disarm(Mover *m, Op *op) {
    if (op->registered) {
        epoll_ctl(m->epfd, EPOLL_CTL_DEL, op->efd >= 0 ? op->efd : op->fd, NULL);
        op->registered = 0;
    }
    if (op->efd >= 0) {
        close(op->efd);
        op->efd = -1;
    }
}

/* GIL held. */
static void free_op(Op *op) {
    if (op->digest) {
        op->digest->in_use = 0;
        Py_DECREF(op->digest);
    }
    for (int i = 0; i < op->nviews; i++) PyBuffer_Release(&op->views[i]);
    PyMem_Free(op->views);
    PyMem_Free(op->iov);
    PyMem_Free(op);
}

static void *mover_main(void *arg) {
    Mover *m = (Mover *)arg;
    struct epoll_event evs[K_EVENTS];
    for (;;) {
        int n = epoll_wait(m->epfd, evs, K_EVENTS, -1);
        if (n < 0) {
            if (errno == EINTR) continue;
            break;
        }
        int finished = 0, stop = 0;
        pthread_mutex_lock(&m->mu);
        for (int i = 0; i < n; i++) {
            unsigned long long token = evs[i].data.u64;
            if (token == 0) {
                stop = 1;
                continue;
            }
            Op *op = find_active(m, token);
            if (op == NULL || op->cancelled) continue;
            op->busy = 1;
            pthread_mutex_unlock(&m->mu);
            int r = run_op(op);
            if (r == EAGAIN) {
                int e = arm(m, op);
                if (e) r = e;
            }
            pthread_mutex_lock(&m->mu);
            op->busy = 0;
            if (op->cancelled) {
                pthread_cond_broadcast(&m->idle);
                continue;
            }
            if (r != EAGAIN) {
                op->status = r;
                disarm(m, op);
                unlink_active(m, op);
                push_done(m, op);
                finished = 1;
            }
        }
        pthread_mutex_unlock(&m->mu);
        if (finished) {
            uint64_t one = 1;
            ssize_t w = write(m->done_efd, &one, sizeof one);
            (void)w; /* the counter cannot overflow at one write per batch */
        }
        if (stop) break;
    }
    return NULL;
}

/* ---- the Python type ---- */

static int Mover_init(Mover *m, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, ":Mover", kwlist)) return -1;
    if (m->running) {
        PyErr_SetString(PyExc_RuntimeError, "Mover already initialised");
        return -1;
    }
    m->epfd = epoll_create1(EPOLL_CLOEXEC);
    m->done_efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    m->stop_efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (m->epfd < 0 || m->done_efd < 0 || m->stop_efd < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    struct epoll_event ev;
    memset(&ev, 0, sizeof ev);
    ev.events = EPOLLIN;
    ev.data.u64 = 0;
    if (epoll_ctl(m->epfd, EPOLL_CTL_ADD, m->stop_efd, &ev) < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    pthread_mutex_init(&m->mu, NULL);
    pthread_cond_init(&m->idle, NULL);
    int err = pthread_create(&m->thread, NULL, mover_main, m);
    if (err) {
        errno = err;
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    m->pid = getpid();
    m->running = 1;
    return 0;
}

static PyObject *Mover_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    Mover *m = (Mover *)type->tp_alloc(type, 0);
    if (m == NULL) return NULL;
    m->epfd = m->done_efd = m->stop_efd = -1;
    return (PyObject *)m;
}

static int check_open(Mover *m) {
    if (!m->running || m->pid != getpid()) {
        PyErr_SetString(PyExc_ValueError, "the Mover is closed");
        return -1;
    }
    return 0;
}

/* Try the new operation here, then hand what is left to the thread.
 * Returns a new reference: (status, done, lowat) with status K_DONE, K_PENDING or
 * K_EOF; raises OSError for a socket error. */
static PyObject *start_op(Mover *m, Op *op) {
    int r;
    Py_ssize_t done;
    int lowat;
    Py_BEGIN_ALLOW_THREADS
    r = run_op(op);
    done = op->done; /* the thread owns the operation once it is active */
    lowat = op->lowat;
    if (r == EAGAIN) {
        /* armed under mu: the thread may take the event at once, and must find the
         * operation whole (linked, registered) when it does */
        pthread_mutex_lock(&m->mu);
        push_active(m, op);
        int e = arm(m, op);
        if (e) {
            disarm(m, op);
            unlink_active(m, op);
            r = e;
        }
        lowat = op->lowat;
        pthread_mutex_unlock(&m->mu);
    }
    Py_END_ALLOW_THREADS
    if (r == EAGAIN) return Py_BuildValue("(inI)", K_PENDING, done, (unsigned)lowat);
    free_op(op);
    if (r == K_DONE || r == K_EOF) return Py_BuildValue("(inI)", r, done, (unsigned)lowat);
    errno = r;
    return PyErr_SetFromErrno(PyExc_OSError);
}

/* digest: None, or an Xxh3 that no operation uses. 0, or -1 with an exception. */
static int check_digest(PyObject *digest) {
    if (digest == Py_None) return 0;
    if (!PyObject_TypeCheck(digest, &Xxh3Type)) {
        PyErr_SetString(PyExc_TypeError, "digest must be an Xxh3 or None");
        return -1;
    }
    if (((Xxh3 *)digest)->in_use) {
        PyErr_SetString(PyExc_RuntimeError, "the Xxh3 is in use by another operation");
        return -1;
    }
    return 0;
}

static void hold_digest(Op *op, PyObject *digest) {
    Py_INCREF(digest);
    op->digest = (Xxh3 *)digest;
    op->digest->in_use = 1;
}

static Op *new_op(int fd, unsigned long long token, int kind, int nviews) {
    Op *op = PyMem_Calloc(1, sizeof(Op));
    if (op == NULL) return NULL;
    op->views = PyMem_Calloc(nviews ? (size_t)nviews : 1, sizeof(Py_buffer));
    op->iov = PyMem_Calloc((size_t)nviews + 1, sizeof(struct iovec)); /* + a trailer */
    if (op->views == NULL || op->iov == NULL) {
        PyMem_Free(op->views);
        PyMem_Free(op->iov);
        PyMem_Free(op);
        return NULL;
    }
    op->fd = fd;
    op->efd = -1;
    op->token = token;
    op->kind = kind;
    return op;
}

PyDoc_STRVAR(Mover_send_doc,
"send(fd, buffers, token, digest=None, hash_from=0, room=False) -> (status, done, 0)\n\n"
"Write every buffer in order to the non-blocking socket fd. status 0: all was\n"
"written here; 1: the rest is the thread's, and (token, status, done, lowat)\n"
"comes from completions() when it ends. Raises OSError on a socket error.\n"
"token must be non-zero and unique among this Mover's active operations.\n"
"digest (a fresh Xxh3): the bytes from stream offset hash_from on are hashed as\n"
"they are written, and its 8-byte little-endian digest is written after them.\n"
"room: finish only once every byte is written and the socket has room again\n"
"(writable: under its unsent low-water mark), or reports an error.");

static PyObject *Mover_send(Mover *m, PyObject *args) {
    int fd;
    PyObject *bufs;
    unsigned long long token;
    PyObject *digest = Py_None;
    Py_ssize_t hash_from = 0;
    int room = 0;
    if (!PyArg_ParseTuple(args, "iOK|Onp:send", &fd, &bufs, &token, &digest, &hash_from, &room))
        return NULL;
    if (check_digest(digest) < 0) return NULL;
    if (hash_from < 0) {
        PyErr_SetString(PyExc_ValueError, "hash_from must not be negative");
        return NULL;
    }
    if (check_open(m) < 0) return NULL;
    if (token == 0) {
        PyErr_SetString(PyExc_ValueError, "token 0 is reserved");
        return NULL;
    }
    PyObject *seq = PySequence_Fast(bufs, "buffers must be a sequence");
    if (seq == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (n > INT32_MAX) {
        Py_DECREF(seq);
        PyErr_SetString(PyExc_OverflowError, "too many buffers");
        return NULL;
    }
    Op *op = new_op(fd, token, OP_SEND, (int)n);
    if (op == NULL) {
        Py_DECREF(seq);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(seq, i), &op->views[i], PyBUF_SIMPLE) < 0) {
            Py_DECREF(seq);
            free_op(op);
            return NULL;
        }
        op->nviews++;
        op->iov[i].iov_base = op->views[i].buf;
        op->iov[i].iov_len = (size_t)op->views[i].len;
        op->total += op->views[i].len;
    }
    Py_DECREF(seq);
    op->niov = (int)n;
    op->room = room;
    if (digest != Py_None) {
        hold_digest(op, digest);
        op->hash_from = hash_from;
        op->iov[op->niov].iov_base = op->trailer;
        op->iov[op->niov].iov_len = sizeof op->trailer;
        op->niov++;
    }
    while (op->iov_i < op->niov && op->iov[op->iov_i].iov_len == 0) op->iov_i++;
    return start_op(m, op);
}

PyDoc_STRVAR(Mover_recv_doc,
"recv(fd, buffer, token, lowat, lowat_cap, digest=None) -> (status, done, lowat)\n\n"
"Fill the writable buffer from the non-blocking socket fd. lowat is the socket's\n"
"SO_RCVLOWAT as last set; while waiting the thread sets it to what is still\n"
"wanted, at most lowat_cap (only when it changes), and the value last set is\n"
"returned here and in completions(). digest (an Xxh3) is updated with the bytes\n"
"as they are read. status 0: filled here; -1: the peer closed first; 1:\n"
"pending, as for send().");

static PyObject *Mover_recv(Mover *m, PyObject *args) {
    int fd, lowat, cap;
    PyObject *buf, *digest = Py_None;
    unsigned long long token;
    if (!PyArg_ParseTuple(args, "iOKii|O:recv", &fd, &buf, &token, &lowat, &cap, &digest))
        return NULL;
    if (check_digest(digest) < 0) return NULL;
    if (check_open(m) < 0) return NULL;
    if (token == 0) {
        PyErr_SetString(PyExc_ValueError, "token 0 is reserved");
        return NULL;
    }
    if (cap < 1) {
        PyErr_SetString(PyExc_ValueError, "lowat_cap must be positive");
        return NULL;
    }
    Op *op = new_op(fd, token, OP_RECV, 1);
    if (op == NULL) return PyErr_NoMemory();
    if (PyObject_GetBuffer(buf, &op->views[0], PyBUF_WRITABLE) < 0) {
        free_op(op);
        return NULL;
    }
    op->nviews = 1;
    op->total = op->views[0].len;
    op->lowat = lowat;
    op->lowat_cap = cap;
    if (digest != Py_None) hold_digest(op, digest);
    return start_op(m, op);
}

/* Take an active operation back (GIL released while waiting for the thread).
 * Returns it unlinked and disarmed, or NULL if it is not active. */
static Op *take(Mover *m, unsigned long long token) {
    Op *op;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&m->mu);
    op = find_active(m, token);
    if (op) {
        op->cancelled = 1;
        while (op->busy) pthread_cond_wait(&m->idle, &m->mu);
        disarm(m, op);
        unlink_active(m, op);
    }
    pthread_mutex_unlock(&m->mu);
    Py_END_ALLOW_THREADS
    return op;
}

PyDoc_STRVAR(Mover_cancel_doc,
"cancel(token) -> (done, lowat) or None\n\n"
"Stop an active operation: once this returns, the thread neither reads into nor\n"
"writes from its buffers again, and no completion will come for it. None if it\n"
"is not active (it finished, and its completion is queued or was collected).");

static PyObject *Mover_cancel(Mover *m, PyObject *args) {
    unsigned long long token;
    if (!PyArg_ParseTuple(args, "K:cancel", &token)) return NULL;
    if (!m->running) Py_RETURN_NONE;
    Op *op = take(m, token);
    if (op == NULL) Py_RETURN_NONE;
    PyObject *r = Py_BuildValue("(nI)", op->done, (unsigned)op->lowat);
    free_op(op);
    return r;
}

PyDoc_STRVAR(Mover_cancel_fd_doc,
"cancel_fd(fd) -> [token, ...]\n\n"
"cancel() every active operation on fd (call it before closing the socket);\n"
"returns their tokens.");

static PyObject *Mover_cancel_fd(Mover *m, PyObject *args) {
    int fd;
    if (!PyArg_ParseTuple(args, "i:cancel_fd", &fd)) return NULL;
    PyObject *out = PyList_New(0);
    if (out == NULL || !m->running) return out;
    for (;;) {
        unsigned long long token = 0;
        pthread_mutex_lock(&m->mu);
        for (Op *op = m->active; op; op = op->next)
            if (op->fd == fd) {
                token = op->token;
                break;
            }
        pthread_mutex_unlock(&m->mu);
        if (token == 0) break;
        Op *op = take(m, token);
        if (op == NULL) continue;
        free_op(op);
        PyObject *t = PyLong_FromUnsignedLongLong(token);
        if (t == NULL || PyList_Append(out, t) < 0) {
            Py_XDECREF(t);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(t);
    }
    return out;
}

PyDoc_STRVAR(Mover_completions_doc,
"completions() -> [(token, status, done, lowat), ...]\n\n"
"The operations the thread finished since the last call, in order, and reset\n"
"fileno()'s readiness.");

static PyObject *Mover_completions(Mover *m, PyObject *Py_UNUSED(ignored)) {
    Op *head;
    PyObject *out = PyList_New(0);
    if (out == NULL || !m->running) return out;
    pthread_mutex_lock(&m->mu);
    uint64_t count;
    ssize_t r = read(m->done_efd, &count, sizeof count); /* reset, under mu: see mover_main */
    (void)r;
    head = m->done_head;
    m->done_head = m->done_tail = NULL;
    pthread_mutex_unlock(&m->mu);
    int failed = 0;
    while (head) {
        Op *op = head;
        head = op->next;
        if (!failed) {
            PyObject *t = Py_BuildValue("(KinI)", op->token, op->status, op->done, (unsigned)op->lowat);
            if (t == NULL || PyList_Append(out, t) < 0) failed = 1;
            Py_XDECREF(t);
        }
        free_op(op);
    }
    if (failed) {
        Py_DECREF(out);
        return NULL;
    }
    return out;
}

static PyObject *Mover_fileno(Mover *m, PyObject *Py_UNUSED(ignored)) {
    if (check_open(m) < 0) return NULL;
    return PyLong_FromLong(m->done_efd);
}

static void mover_close(Mover *m) {
    if (m->running && m->pid != getpid()) {
        /* a forked child: the thread, its operations and the buffers they held are
         * the parent's; drop only the descriptors */
        m->running = 0;
        m->active = m->done_head = m->done_tail = NULL;
    }
    if (m->running) {
        uint64_t one = 1;
        ssize_t w = write(m->stop_efd, &one, sizeof one);
        (void)w;
        Py_BEGIN_ALLOW_THREADS
        pthread_join(m->thread, NULL);
        Py_END_ALLOW_THREADS
        m->running = 0;
        while (m->active) {
            Op *op = m->active;
            unlink_active(m, op);
            disarm(m, op);
            free_op(op);
        }
        while (m->done_head) {
            Op *op = m->done_head;
            m->done_head = op->next;
            free_op(op);
        }
        m->done_tail = NULL;
        pthread_mutex_destroy(&m->mu);
        pthread_cond_destroy(&m->idle);
    }
    if (m->epfd >= 0) close(m->epfd);
    if (m->done_efd >= 0) close(m->done_efd);
    if (m->stop_efd >= 0) close(m->stop_efd);
    m->epfd = m->done_efd = m->stop_efd = -1;
}

PyDoc_STRVAR(Mover_close_doc,
"close()\n\n"
"Stop the thread and drop every operation (no completions for them). Idempotent.");

static PyObject *Mover_close(Mover *m, PyObject *Py_UNUSED(ignored)) {
    mover_close(m);
    Py_RETURN_NONE;
}

static void Mover_dealloc(Mover *m) {
    mover_close(m);
    Py_TYPE(m)->tp_free((PyObject *)m);
}

static PyMethodDef Mover_methods[] = {
    {"send", (PyCFunction)Mover_send, METH_VARARGS, Mover_send_doc},
    {"recv", (PyCFunction)Mover_recv, METH_VARARGS, Mover_recv_doc},
    {"cancel", (PyCFunction)Mover_cancel, METH_VARARGS, Mover_cancel_doc},
    {"cancel_fd", (PyCFunction)Mover_cancel_fd, METH_VARARGS, Mover_cancel_fd_doc},
    {"completions", (PyCFunction)Mover_completions, METH_NOARGS, Mover_completions_doc},
    {"fileno", (PyCFunction)Mover_fileno, METH_NOARGS, "The eventfd that is readable while completions wait."},
    {"close", (PyCFunction)Mover_close, METH_NOARGS, Mover_close_doc},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject MoverType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "pddnet.transport.wan._mover.Mover",
    .tp_doc = PyDoc_STR("System calls of socket reads and writes on a native thread (see the module)."),
    .tp_basicsize = sizeof(Mover),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = Mover_new,
    .tp_init = (initproc)Mover_init,
    .tp_dealloc = (destructor)Mover_dealloc,
    .tp_methods = Mover_methods,
};

/* ---- Xxh3 ---- */

static PyObject *Xxh3_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    if (!PyArg_ParseTuple(args, ":Xxh3")) return NULL;
    if (xxh3_create == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "XXH3 is not bound (bind_xxh3)");
        return NULL;
    }
    Xxh3 *h = (Xxh3 *)type->tp_alloc(type, 0);
    if (h == NULL) return NULL;
    h->state = xxh3_create();
    if (h->state == NULL || xxh3_reset(h->state) != 0) {
        Py_DECREF(h);
        return PyErr_NoMemory();
    }
    return (PyObject *)h;
}

static void Xxh3_dealloc(Xxh3 *h) {
    if (h->state) xxh3_free(h->state);
    Py_TYPE(h)->tp_free((PyObject *)h);
}

static int check_idle(Xxh3 *h) {
    if (h->in_use) {
        PyErr_SetString(PyExc_RuntimeError, "the Xxh3 is in use by an operation");
        return -1;
    }
    return 0;
}

static PyObject *Xxh3_update(Xxh3 *h, PyObject *arg) {
    Py_buffer view;
    if (check_idle(h) < 0) return NULL;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0) return NULL;
    Py_BEGIN_ALLOW_THREADS
    xxh3_update(h->state, view.buf, (size_t)view.len);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    Py_RETURN_NONE;
}

static PyObject *Xxh3_intdigest(Xxh3 *h, PyObject *Py_UNUSED(ignored)) {
    if (check_idle(h) < 0) return NULL;
    return PyLong_FromUnsignedLongLong(xxh3_digest(h->state));
}

static PyMethodDef Xxh3_methods[] = {
    {"update", (PyCFunction)Xxh3_update, METH_O, "Add the bytes of a buffer."},
    {"intdigest", (PyCFunction)Xxh3_intdigest, METH_NOARGS, "The XXH3-64 of all bytes so far."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject Xxh3Type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "pddnet.transport.wan._mover.Xxh3",
    .tp_doc = PyDoc_STR("An XXH3-64 digest (seed 0) that a receive can update on the thread."),
    .tp_basicsize = sizeof(Xxh3),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = Xxh3_new,
    .tp_dealloc = (destructor)Xxh3_dealloc,
    .tp_methods = Xxh3_methods,
};

PyDoc_STRVAR(bind_xxh3_doc,
"bind_xxh3(path) -> bool\n\n"
"Resolve XXH3's functions from the already loaded shared object at path\n"
"(python-xxhash's extension). False if it does not export them.");

static PyObject *bind_xxh3(PyObject *mod, PyObject *args) {
    const char *path;
    if (!PyArg_ParseTuple(args, "s:bind_xxh3", &path)) return NULL;
    void *lib = dlopen(path, RTLD_NOW | RTLD_NOLOAD);
    if (lib == NULL) Py_RETURN_FALSE;
    void *create = dlsym(lib, "XXH3_createState");
    void *free_ = dlsym(lib, "XXH3_freeState");
    void *reset = dlsym(lib, "XXH3_64bits_reset");
    void *update = dlsym(lib, "XXH3_64bits_update_dispatch");
    if (update == NULL) update = dlsym(lib, "XXH3_64bits_update");
    void *digest = dlsym(lib, "XXH3_64bits_digest");
    if (!create || !free_ || !reset || !update || !digest) {
        dlclose(lib);
        Py_RETURN_FALSE;
    }
    /* the handle stays open: the functions are used for the process's life */
    *(void **)&xxh3_create = create;
    *(void **)&xxh3_free = free_;
    *(void **)&xxh3_reset = reset;
    *(void **)&xxh3_update = update;
    *(void **)&xxh3_digest = digest;
    Py_RETURN_TRUE;
}

static PyMethodDef module_methods[] = {
    {"bind_xxh3", bind_xxh3, METH_VARARGS, bind_xxh3_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef mover_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "pddnet.transport.wan._mover",
    .m_doc = PyDoc_STR("The WAN data path's socket system calls on a native thread."),
    .m_size = -1,
    .m_methods = module_methods,
};

PyMODINIT_FUNC PyInit__mover(void) {
    if (PyType_Ready(&MoverType) < 0 || PyType_Ready(&Xxh3Type) < 0) return NULL;
    PyObject *mod = PyModule_Create(&mover_module);
    if (mod == NULL) return NULL;
    Py_INCREF(&MoverType);
    if (PyModule_AddObject(mod, "Mover", (PyObject *)&MoverType) < 0) {
        Py_DECREF(&MoverType);
        Py_DECREF(mod);
        return NULL;
    }
    Py_INCREF(&Xxh3Type);
    if (PyModule_AddObject(mod, "Xxh3", (PyObject *)&Xxh3Type) < 0) {
        Py_DECREF(&Xxh3Type);
        Py_DECREF(mod);
        return NULL;
    }
    if (PyModule_AddIntConstant(mod, "PENDING", K_PENDING) < 0 ||
        PyModule_AddIntConstant(mod, "DONE", K_DONE) < 0 ||
        PyModule_AddIntConstant(mod, "EOF", K_EOF) < 0) {
        Py_DECREF(mod);
        return NULL;
    }
    return mod;
}
