/* autocast.h: the autocast object's layout, shared by autocast.c (the type) and state.c (the
 * readers of the innermost active autocast). Not part of any public API.
 */
#ifndef TEQUANT_EXT_AUTOCAST_H_
#define TEQUANT_EXT_AUTOCAST_H_

#include "module.h"

/* An autocast object is also the "frame" stored in the ContextVar while it is the innermost
 * active autocast. A frame's fields never change once published, because a copied context
 * (asyncio task, copy_context) may keep it as its current state after this block has exited;
 * re-entering an instance publishes a fresh clone instead. */
typedef struct AutocastObject {
    PyObject_HEAD
    tqx_state *st;      /* the module's state; the type keeps the module alive */
    PyObject *recipe;   /* strong; never None (None resolves to the default recipe) */
    PyObject *group;    /* strong; amax reduction group or None */
    Py_ssize_t key;     /* recipe key */
    char enabled;
    char calibrating;
    /* frame fields, fixed when published */
    char published;
    char first_module;  /* on a root frame: no quantized module has asked yet (mutable flag) */
    int depth;          /* 1 for the outermost */
    struct AutocastObject *root; /* strong: the outermost frame; NULL when this is the root */
    PyObject *pending;  /* on a root frame: list of the DelayedScaling modules that quantized in
                           it (state.c _delayed_register), handed to the update at its exit */
    char pending_owned; /* on a root frame: a module whose call records a backward was handed
                           `pending` (that backward runs the backward update) */
    /* instance fields */
    char active;        /* between __enter__ and __exit__ */
    PyObject *token;    /* strong while active: restores the outer state */
} AutocastObject;

static inline AutocastObject *tqx_frame_root(AutocastObject *frame) {
    return frame->root ? frame->root : frame;
}

/* state.c: the innermost active autocast of this thread / context (borrowed), or NULL (*error
 * set on a failed read, else none is active) */
AutocastObject *tqx_autocast_innermost(tqx_state *st, int *error);
/* state.c: appends the module obj to the outermost autocast's list of DelayedScaling modules;
 * claims: obj's call records a backward; *first: the first that does (it runs the backward
 * update). -1 with an exception. */
int tqx_delayed_register(AutocastObject *ac, PyObject *obj, int claims, int *first);

#endif /* TEQUANT_EXT_AUTOCAST_H_ */
