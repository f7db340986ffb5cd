// The PTX of capi/gather_kernel.cu (nvcc -arch=compute_75 -ptx, ".version" lowered from 9.0 to 7.0: it uses
// no newer instruction, and drivers since CUDA 11 JIT-compile it). Regenerate it when the kernel changes.
#pragma once

namespace diffrun::capi {

inline constexpr char kGatherPtx[] = R"ptx(
.version 7.0
.target sm_75
.address_size 64

	// .globl	diffrun_gather

.visible .entry diffrun_gather(
	.param .align 8 .b8 diffrun_gather_param_0[1544]
)
{
	.reg .pred 	%p<10>;
	.reg .b16 	%rs<2>;
	.reg .b32 	%r<16>;
	.reg .b64 	%rd<46>;


	mov.b64 	%rd26, diffrun_gather_param_0;
	ld.param.u32 	%r2, [diffrun_gather_param_0+1536];
	mov.u32 	%r1, %ctaid.y;
	setp.ge.s32 	%p1, %r1, %r2;
	@%p1 bra 	$L__BB0_14;

	mul.wide.s32 	%rd27, %r1, 24;
	add.s64 	%rd28, %rd26, %rd27;
	ld.param.u64 	%rd2, [%rd28+16];
	ld.param.u64 	%rd3, [%rd28];
	ld.param.u64 	%rd4, [%rd28+8];
	mov.u32 	%r3, %nctaid.x;
	mov.u32 	%r4, %ntid.x;
	mul.wide.u32 	%rd5, %r3, %r4;
	mov.u32 	%r5, %ctaid.x;
	mul.wide.u32 	%rd29, %r5, %r4;
	mov.u32 	%r6, %tid.x;
	cvt.u64.u32 	%rd30, %r6;
	add.s64 	%rd6, %rd29, %rd30;
	or.b64  	%rd7, %rd4, %rd3;
	and.b64  	%rd31, %rd7, 15;
	setp.eq.s64 	%p2, %rd31, 0;
	@%p2 bra 	$L__BB0_7;

	and.b64  	%rd33, %rd7, 3;
	setp.ne.s64 	%p3, %rd33, 0;
	mov.u64 	%rd44, 0;
	@%p3 bra 	$L__BB0_11;

	shr.u64 	%rd8, %rd2, 2;
	setp.ge.u64 	%p4, %rd6, %rd8;
	@%p4 bra 	$L__BB0_6;

	cvta.to.global.u64 	%rd9, %rd3;
	cvta.to.global.u64 	%rd10, %rd4;
	mov.u64 	%rd42, %rd6;

$L__BB0_5:
	shl.b64 	%rd34, %rd42, 2;
	add.s64 	%rd35, %rd9, %rd34;
	ld.global.u32 	%r7, [%rd35];
	add.s64 	%rd36, %rd10, %rd34;
	st.global.u32 	[%rd36], %r7;
	add.s64 	%rd42, %rd42, %rd5;
	setp.lt.u64 	%p5, %rd42, %rd8;
	@%p5 bra 	$L__BB0_5;

$L__BB0_6:
	and.b64  	%rd44, %rd2, -4;
	bra.uni 	$L__BB0_11;

$L__BB0_7:
	shr.u64 	%rd14, %rd2, 4;
	setp.ge.u64 	%p6, %rd6, %rd14;
	@%p6 bra 	$L__BB0_10;

	cvta.to.global.u64 	%rd15, %rd4;
	cvta.to.global.u64 	%rd16, %rd3;
	mov.u64 	%rd43, %rd6;

$L__BB0_9:
	shl.b64 	%rd37, %rd43, 4;
	add.s64 	%rd38, %rd16, %rd37;
	add.s64 	%rd39, %rd15, %rd37;
	ld.global.v4.u32 	{%r8, %r9, %r10, %r11}, [%rd38];
	st.global.v4.u32 	[%rd39], {%r8, %r9, %r10, %r11};
	add.s64 	%rd43, %rd43, %rd5;
	setp.lt.u64 	%p7, %rd43, %rd14;
	@%p7 bra 	$L__BB0_9;

$L__BB0_10:
	and.b64  	%rd44, %rd2, -16;

$L__BB0_11:
	add.s64 	%rd45, %rd44, %rd6;
	setp.ge.u64 	%p8, %rd45, %rd2;
	@%p8 bra 	$L__BB0_14;

	cvta.to.global.u64 	%rd22, %rd3;
	cvta.to.global.u64 	%rd23, %rd4;

$L__BB0_13:
	add.s64 	%rd40, %rd22, %rd45;
	ld.global.u8 	%rs1, [%rd40];
	add.s64 	%rd41, %rd23, %rd45;
	st.global.u8 	[%rd41], %rs1;
	add.s64 	%rd45, %rd45, %rd5;
	setp.lt.u64 	%p9, %rd45, %rd2;
	@%p9 bra 	$L__BB0_13;

$L__BB0_14:
	ret;

}
)ptx";

inline constexpr const char* kGatherEntry = "diffrun_gather";
inline constexpr int kGatherMaxItems = 64;  // DiffrunGatherBatch::item

}  // namespace diffrun::capi
