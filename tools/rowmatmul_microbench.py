"""Few-row kernel vs XLA dot at T5-Base width (output: rowmatmul_microbench.txt)."""
import time, sys, jax, jax.numpy as jnp, numpy as np
from t5x_speed import rowmatmul as rm
print(rm._load())
def bench(f, *a, n=15):
  jax.block_until_ready(f(*a)); ts=[]
  for _ in range(n):
    t=time.perf_counter(); jax.block_until_ready(f(*a)); ts.append(time.perf_counter()-t)
  return min(ts)*1e3
key=jax.random.PRNGKey(0)
for dt in (jnp.float32, jnp.bfloat16):
  ws=[jax.random.normal(jax.random.fold_in(key,i),(2048,768) if i%3==2 else (768,2048),dt) for i in range(24)]
  for M in (1,2,3,4,12,48):
    x=jnp.ones((M,768),dt)
    def chain(x, ws, force):
      y=x
      for w in ws:
        if w.shape[0]==768: z=rm.matmul(y,w,force_xla=force)
        else: y=rm.matmul(z,w,force_xla=force)*0.01
      return y
    k=bench(jax.jit(lambda x,ws: chain(x,ws,False)),x,ws)
    xl=bench(jax.jit(lambda x,ws: chain(x,ws,True)),x,ws)
    nb=sum(w.nbytes for w in ws)
    print(dt.__name__, M, f'kernel {k:.2f} ms ({nb/k/1e6:.1f} GB/s) xla {xl:.2f} ms')
  E=jax.random.normal(key,(32128,768),dt)
  for M in (1,3,12):
    x=jnp.ones((M,768),dt)
    k=bench(jax.jit(lambda x,E: rm.matmul(x,E,transpose_w=True)),x,E)
    xl=bench(jax.jit(lambda x,E: rm.matmul(x,E,transpose_w=True,force_xla=True)),x,E)
    print(dt.__name__,'classifier',M, f'kernel {k:.2f} ms ({E.nbytes/k/1e6:.1f} GB/s) xla {xl:.2f}')
