# diffrun_library(NAME DIR DEPS...): a static library from every .cpp (and .cu) in one folder.
# An empty folder yields an interface target so the tree configures while a unit is being written.
function(diffrun_library name)
  cmake_parse_arguments(A "" "" "DEPS;PRIVATE_DEPS;GLOBS" ${ARGN})
  if(NOT A_GLOBS)
    set(A_GLOBS *.cpp)
  endif()
  set(srcs)
  foreach(g ${A_GLOBS})
    file(GLOB_RECURSE found CONFIGURE_DEPENDS ${CMAKE_CURRENT_SOURCE_DIR}/${g})
    list(APPEND srcs ${found})
  endforeach()
  if(srcs)
    add_library(${name} STATIC ${srcs})
    target_include_directories(${name} PUBLIC ${PROJECT_SOURCE_DIR})
    target_link_libraries(${name} PUBLIC ${A_DEPS} PRIVATE ${A_PRIVATE_DEPS} diffrun_warnings)
  else()
    add_library(${name} INTERFACE)
    target_include_directories(${name} INTERFACE ${PROJECT_SOURCE_DIR})
    target_link_libraries(${name} INTERFACE ${A_DEPS})
  endif()
endfunction()

# diffrun_embed_json(TARGET DIR HEADER NAMESPACE FUNCTION TYPE): compiles every DIR/*.json (relative to the
# source tree) into TARGET as FUNCTION() (declared in HEADER), so an installed diffrun needs no source tree.
function(diffrun_embed_json target dir header namespace function type)
  file(GLOB files CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/${dir}/*.json)
  list(SORT files)
  string(REPLACE ";" "|" files_arg "${files}")
  set(out ${CMAKE_CURRENT_BINARY_DIR}/${function}.cpp)
  add_custom_command(
    OUTPUT ${out}
    COMMAND ${CMAKE_COMMAND} -DOUT=${out} "-DFILES=${files_arg}" -DSOURCE=${dir}/*.json -DHEADER=${header}
            -DNAMESPACE=${namespace} -DFUNCTION=${function} -DTYPE=${type}
            -P ${PROJECT_SOURCE_DIR}/cmake/embed_json.cmake
    DEPENDS ${files} ${PROJECT_SOURCE_DIR}/cmake/embed_json.cmake
    COMMENT "Embedding ${dir}/*.json"
    VERBATIM)
  target_sources(${target} PRIVATE ${out})
endfunction()
